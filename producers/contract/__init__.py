"""The event contract: events and their field rules, run ids, topics, dead letters, run status,
settings and the error tree. It imports nothing else of the project; everything else builds on it."""
