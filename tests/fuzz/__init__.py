"""The differential fuzzer: hypothesis draws calls over headwise's whole public surface that
combine features (entry points, module paths, rules, layouts, dtypes, empty sizes, NaN and
inf at excluded positions, lse, weights, gradients, torch.func, torch.compile, two gloo
ranks) and checks every result against one float64 oracle, ``headwise.testing.reference_attention``.
A call may be refused (ValueError / TypeError with a message); then every piece of state it
could touch (parameters, caches, paged pools, the memos) must be as it was.

CI runs the fixed, derandomized profile ``fuzz-ci`` (a budget well inside a minute on two
cores). The long run, thousands of fresh examples per test::

    HEADWISE_FUZZ=long python -m pytest -q -p no:cacheprovider tests/fuzz

``HEADWISE_FUZZ=long`` also draws more cases for the two-rank distributed fuzz. The long
profile is not derandomized; ``--hypothesis-seed=N`` makes a run repeatable, and
``HEADWISE_FUZZ_SEED=N`` draws other cases for the distributed fuzz (7 by default).
"""
