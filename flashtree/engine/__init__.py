"""The engine: requests, the scheduler, one decode round and its host side, prefill, graphs, traces."""
