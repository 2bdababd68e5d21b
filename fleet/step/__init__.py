"""``fleet.distributed_step``: from a call to its compiled program and back.

The decorator and its per-call path (``_decorator``), the one decision path
(``_decide``), what each argument is (``_roles``), the NNX graph it carries
(``_graph``), the fast path's cache (``_recall``), a plan's compiled program
(``_jitted``), the traced program (``_program``), its body's end and the
outputs' combination (``_tail``), its first trace (``_first_trace``) and the
checks read from the probe (``_probe_checks``), the contract's guards
(``_guards``, ``_rows``), where arguments live (``_global_arrays``), donation
(``_donate``) and verify mode (``_verify``, ``_verify_reference``, ``_verify_compare``,
``_verify_sections``). The top of the core: builds on every layer below.
"""
