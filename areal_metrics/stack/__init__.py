"""The local stack: a Kafka broker (or cluster) from Maven jars, the stream worker and the sink as processes."""
