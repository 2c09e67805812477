import os

# Keep each test process (and every rank it spawns) to one intra-op thread
# unless a test asks for more: CI has 2 cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
