"""Getting events to Kafka without making the trainer wait: the publisher's sender thread,
the Kafka producer backends it hands messages to, and the journal for when the broker is away."""
