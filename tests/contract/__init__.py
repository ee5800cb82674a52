"""The correctness contract: with cudagraphex a program computes exactly what it computes without it.

One module per point of the contract (``test_<point>_*.py``) and a randomized check of all of them together. Each
point has user-level scenarios, run on the CPU replay backend and on real CUDA graphs, and one test that switches the
point's protection off and shows the program going wrong.
"""
