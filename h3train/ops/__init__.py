"""Kernel choices shared by training and the benchmarks, each described once (`attention.py`)."""
