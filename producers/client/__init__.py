"""The public client a trainer calls: `init()` -> `Run` (run.py), value coercion, metric aliases,
exit hooks, the launcher's environment, attempts of a resumed run and the control feed."""
