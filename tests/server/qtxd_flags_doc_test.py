#!/usr/bin/python3
"""qtxd's flags, its --help and the README's flag table agree.

Every ABSL_FLAG defined in server/config/flags.cc must
  * be listed by `qtxd --help` and `qtxd --helpshort` (Abseil's default help
    filter shows only flags of a file named like the program, which printed
    "No flags matched" for qtxd), and
  * have a row in README.md's "qtxd flags" table;
and the table must not name a flag qtxd does not have.

  qtxd_flags_doc_test.py --qtxd=build/server/qtxd --source=.
"""
import argparse
import re
import subprocess
import sys


def defined_flags(flags_cc):
    text = open(flags_cc, encoding="utf-8").read()
    names = re.findall(r"ABSL_FLAG\(\s*[\w:<>]+\s*,\s*(\w+)\s*,", text)
    if len(names) < 10:
        raise SystemExit(f"found only {len(names)} ABSL_FLAG definitions in {flags_cc}")
    return set(names)


def readme_table_flags(readme):
    text = open(readme, encoding="utf-8").read()
    m = re.search(r"^## qtxd flags\n(.*?)(?=^## )", text, re.S | re.M)
    if not m:
        raise SystemExit("README.md has no '## qtxd flags' section")
    names = set()
    for line in m.group(1).splitlines():
        if not line.startswith("| `--"):
            continue
        first_cell = line.split("|")[1]
        names.update(re.findall(r"`--(\w+)`", first_cell))
    return names


def help_output(qtxd, flag):
    p = subprocess.run([qtxd, flag], capture_output=True, text=True, timeout=60)
    return p.returncode, p.stdout + p.stderr


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--qtxd", required=True)
    ap.add_argument("--source", required=True)
    args = ap.parse_args()

    flags = defined_flags(f"{args.source}/server/config/flags.cc")
    problems = []
    for help_flag in ("--help", "--helpshort"):
        _, out = help_output(args.qtxd, help_flag)
        if "No flags matched" in out:
            problems.append(f"qtxd {help_flag} printed 'No flags matched'")
        if "Flags from server/config/flags.cc" not in out:
            problems.append(f"qtxd {help_flag} does not name server/config/flags.cc")
        listed = set(re.findall(r"^\s+--(\w+) \(", out, re.M))
        for name in sorted(flags - listed):
            problems.append(f"qtxd {help_flag} does not list --{name}")
    table = readme_table_flags(f"{args.source}/README.md")
    for name in sorted(flags - table):
        problems.append(f"README.md's flag table has no row for --{name}")
    for name in sorted(table - flags):
        problems.append(f"README.md's flag table names --{name}, which qtxd does not define")

    if problems:
        print("\n".join(problems))
        return 1
    print(f"ok: {len(flags)} flags in flags.cc, --help, --helpshort and README.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
