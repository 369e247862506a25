import pytest
from test_result_contract import RESULT_TYPES, build, instances  # noqa

def test_fp(instances):
    rows = []
    for cls in RESULT_TYPES:
        try:
            r = build(cls, instances)
        except Exception as e:
            rows.append((cls.__name__, "ERR", str(e)[:80])); continue
        m = getattr(r, "meta", None)
        rows.append((cls.__name__, isinstance(m, dict) and "fingerprint" in m, sorted(m)[:12] if isinstance(m, dict) else m))
    for row in rows: print(row)
