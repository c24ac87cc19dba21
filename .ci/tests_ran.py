"""Fails (exit 1) when a pytest JUnit XML report shows no test that ran and passed, so that a stage
whose tests all skip (a missing library, a wrong environment variable) cannot pass unnoticed.

    python .ci/tests_ran.py REPORT.xml
"""
import sys
import xml.etree.ElementTree as ET


def main(path: str) -> int:
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    count = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "skipped", "failures", "errors")}
    passed = count["tests"] - count["skipped"] - count["failures"] - count["errors"]
    print(f"{path}: {passed} passed, {count['skipped']} skipped, {count['failures']} failed, {count['errors']} errors")
    if passed == 0 or count["failures"] or count["errors"]:
        print("no test ran and passed" if passed == 0 else "failures in the report")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
