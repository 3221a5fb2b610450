"""The Faust shell: topics in, batches through the core, records out. It only moves events."""
