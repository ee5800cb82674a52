"""Whole-step graphs (:func:`cudagraphex.graph_step`): a step replayed from one graph computes what running it does.

Every test runs the step twice in lock-step, through ``graph_step`` and as plain Thunder, from the same parameters and
seeds, and compares what a caller can observe after every call: the returned values, parameters, gradients (and which
are None), buffers and optimizer state (``twins.Pair``). On the CPU replay backend the comparison is exact.

``test_computes``: what a replayed step computes; ``test_guards``: each change of state between steps is seen;
``test_not_captured``: what keeps a step from being captured, and bad input; ``test_buckets``: batch-size buckets.

The points of the contract (``tests/contract/``) through the whole-step path:

1. Outputs the caller holds are never overwritten: ``test_outputs_the_caller_keeps_are_never_overwritten``.
2. Saved tensors: a step consumes its own autograd graph, and what it returns is detached; an argument that requires
   grad keeps the step from being captured (``test_an_argument_that_requires_grad_is_not_captured``).
3. In-place updates, applied once per call: ``test_an_argument_written_in_place_is_updated_once_per_call``,
   ``test_arguments_that_share_memory_are_not_copied_apart``, ``test_batchnorm_running_statistics_follow_every_step``,
   the optimizer state in every test.
4. Fresh random draws: ``test_dropout_draws_fresh_values_on_every_replay``.
5. Per-call host values: ``test_python_values_passed_to_the_step_key_its_graphs``, the learning rate in
   ``test_a_change_of_state_between_steps_is_seen``, ``test_a_step_that_reads_a_value_on_the_host_is_not_captured``.
6. New shapes and the graph budget: ``test_a_new_batch_shape_warms_up_and_captures_again``,
   ``test_past_max_graphs_the_step_runs_without_its_graph``.
7. A failed capture: ``test_a_failed_capture_runs_the_step_as_is`` (CUDA: the CPU backend's capture cannot fail).
8. Bad input and CPU work: ``test_bad_options_raise``, ``test_a_non_capturable_optimizer_is_not_captured``.
9. Threads: ``test_two_threads_each_with_its_own_step``.
"""
