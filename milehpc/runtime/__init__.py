"""Inside the job, above everything else: ``launch`` (every rank's entry), ``signals`` (wall time, requeue, the
checkpoint request), ``metrics`` (TensorBoard, JSONL, progress), ``offload`` (colocated GPU sharing with
torch_memory_saver), ``foreground`` (``milehpc run``), and the RL loop (``loop/``)."""
