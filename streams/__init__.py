"""The stream worker (`python -m areal_metrics.streams`), in three rooms:

- `core/`: the pure rules (smoothing, triggers, voting, alerts, the closed loop) and
  `processor`, one run's state and what each input does to it;
- `state/`: the one codec of the stored state and its layout in Faust's table;
- `shell/`: the Faust app, its consumer and the batch that moves bytes through the core.

See docs/STREAMS.md.
"""
