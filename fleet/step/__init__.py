"""``fleet.distributed_step``: from a call to its compiled program and back.

The decorator and its per-call path (``_decorator``), what each argument is
(``_roles``), the NNX graph it carries (``_graph``), the fast path's cache
(``_recall``), the traced program (``_program``), the contract's guards
(``_guards``, ``_rows``), where arguments live (``_global_arrays``), donation
(``_donate``) and verify mode (``_verify``, ``_verify_compare``,
``_verify_sections``). The top of the core: builds on every layer below.
"""
