"""Helpers shared by the test files (no test file imports another).

`kit.graphs`: tiny MLA models, their inputs, graph rendering for pins, matcher captures and a fake
process group. `kit.kernels`: float64 attention references and comparisons for the
kernel tests.
"""
