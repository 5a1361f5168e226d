"""The scheduler: which requests run each step, the pages they get, retraction and
preemption under pressure, and the prefix cache."""
