"""The command line and the local stack: wires producers, streams, sinks and areal_train."""
