"""Switches for cudagraphex's correctness protections.

They exist so that the tests can prove each protection is needed: every test that switches one off asserts that the
program then computes something wrong. Never change them in real use.
"""

PROTECTIONS: dict[str, bool] = {
    # runtime: a graph never overwrites a storage that something outside cudagraphex references
    "output_liveness": True,
    # runtime: a graph never replays against a static input that moved
    "static_address_guard": True,
    # runtime: a graph that gave saved tensors' memory back replays only while the call alone references them
    "given_back_guard": True,
    # runtime: a new shape, dtype or stride gets its own graph
    "signature_guard": True,
    # runtime: a copied input the graph writes in place is copied back after the replay
    "copy_back_mutated_inputs": True,
    # executor: trace inputs the graph writes in place stay static, so the writes land in them
    "mutated_inputs_stay_static": True,
    # safety: symbols that use host values computed at run time stay out of graphs
    "host_values_stay_out": True,
    # capture: a capture restores the RNG state (the emulation's capture run draws from it; a failed one may too)
    "restore_rng_after_capture": True,
    # capture: the emulation undoes the in-place writes of its capture run, as a real capture makes none
    "undo_capture_side_effects": True,
    # step: a call is padded into a larger batch's graph only where the row check finds its rows independent
    "row_independence_check": True,
}
