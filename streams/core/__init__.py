"""The stream worker's pure core: smoothing, triggers, voting, alert rules and the closed loop,
as typed functions over small frozen state. No Faust, no Kafka, no I/O."""
