"""examples/serve_paged.py --quick: requests join and leave mid-stream, the system prompt is
shared (not copied) and attended once, and every request gets the tokens it gets alone."""

from __future__ import annotations

import re

from conftest import run_example


def test_quick_run_serves_every_request_as_one_at_a_time_would():
    run = run_example("serve_paged.py", "--quick")
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    assert "every request got the same tokens both ways: True" in out, out
    widest = int(re.search(r"up to (\d+) requests a step", out).group(1))
    assert widest >= 5, out  # several requests decode together
    assert int(re.search(r"attended once for all running requests in (\d+) of", out).group(1)) > 0, out
    pages, copies = map(int, re.search(r"at most (\d+) pages in use per layer \(copies of the system prompt "
                                       r"alone would take (\d+)\)", out).groups())
    assert pages < copies, out
    assert "now 16 in use" in out  # every request freed its pages; the system prompt's remain
    assert re.search(r"paged: .* [\d.]+ tokens/s", out) and re.search(r"one at a time: [\d.]+ tokens/s", out)
