#!/usr/bin/python3
"""Lints docker/Dockerfile.* without a Docker engine (hadolint is not in
Debian): multi-stage shape, build stage runs docker/build.sh (which runs
scripts/install_deps.sh and deploy/bundle/make_bundle.sh), every COPY source
exists in the build context and is not dropped by .dockerignore, COPY --from
names an earlier stage, the runtime stage runs as a non-root USER, has a
HEALTHCHECK with `qtx ... health` and an ENTRYPOINT that runs qtxd; the CUDA
image builds on nvidia/cuda devel and runs on nvidia/cuda runtime.

  docker/check_dockerfiles.py [--self-test]
"""

import fnmatch
import os
import re
import shlex
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def instructions(text):
    """[(KEYWORD, args)] with continuation lines joined, comments dropped."""
    out, cur = [], ""
    for line in text.splitlines():
        if not cur and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            cur += line.rstrip()[:-1] + " "
            continue
        cur += line
        kw, _, args = cur.strip().partition(" ")
        out.append((kw.upper(), args.strip()))
        cur = ""
    return out


def ignored(path, patterns):
    hit = False
    for p in patterns:
        neg = p.startswith("!")
        p = p[1:] if neg else p
        parts = path.split("/")
        prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        if any(fnmatch.fnmatch(x, p) or fnmatch.fnmatch(x, p.replace("**/", "")) for x in prefixes):
            hit = not neg
    return hit


def check(text, name, repo=REPO, cuda=False):
    errors = []
    ins = instructions(text)
    ignore_file = os.path.join(repo, ".dockerignore")
    patterns = []
    if os.path.exists(ignore_file):
        patterns = [l.strip() for l in open(ignore_file) if l.strip() and not l.startswith("#")]
    stages = []  # [{"name", "image", "ins": []}]
    args = {}
    for kw, a in ins:
        if kw == "ARG" and not stages:
            k, _, v = a.partition("=")
            args[k] = v
        if kw == "FROM":
            m = re.match(r"(\S+)(?:\s+AS\s+(\S+))?", a, re.I)
            image = re.sub(r"\$\{(\w+)\}", lambda x: args.get(x.group(1), ""), m.group(1))
            stages.append({"name": m.group(2), "image": image, "ins": []})
        elif stages:
            stages[-1]["ins"].append((kw, a))
    if len(stages) < 2:
        return ["%s: needs a build stage and a runtime stage (found %d FROM)" % (name, len(stages))]
    build, final = stages[0], stages[-1]
    if not any(kw == "RUN" and "docker/build.sh" in a for kw, a in build["ins"]):
        errors.append("%s: the build stage does not RUN docker/build.sh" % name)
    names = set()
    for st in stages:
        for kw, a in st["ins"]:
            if kw != "COPY":
                continue
            toks = shlex.split(a)
            opts = [t for t in toks if t.startswith("--")]
            srcs = [t for t in toks if not t.startswith("--")][:-1]
            frm = [o.split("=", 1)[1] for o in opts if o.startswith("--from=")]
            if frm:
                if frm[0] not in names:
                    errors.append("%s: COPY --from=%s names no earlier stage" % (name, frm[0]))
                continue
            for s in srcs:
                p = os.path.normpath(os.path.join(repo, s))
                if not os.path.exists(p):
                    errors.append("%s: COPY source '%s' does not exist" % (name, s))
                elif s not in (".", "./") and ignored(os.path.relpath(p, repo), patterns):
                    errors.append("%s: COPY source '%s' is excluded by .dockerignore" % (name, s))
        if st["name"]:
            names.add(st["name"])
    for needed in ("docker/build.sh", "scripts/install_deps.sh", "deploy/bundle/make_bundle.sh",
                   "CMakeLists.txt", "server", "client", "proto", "kernels"):
        if ignored(needed, patterns):
            errors.append("%s: .dockerignore drops %s, which the build needs" % (name, needed))
    users = [a for kw, a in final["ins"] if kw == "USER"]
    if not users:
        errors.append("%s: the runtime stage has no USER (it would run as root)" % name)
    elif users[-1].split(":")[0] in ("root", "0"):
        errors.append("%s: the runtime stage runs as root (USER %s)" % (name, users[-1]))
    hc = [a for kw, a in final["ins"] if kw == "HEALTHCHECK"]
    if not hc or not re.search(r"qtx\b.*\bhealth", hc[-1]):
        errors.append("%s: the runtime stage needs HEALTHCHECK ... CMD qtx ... health" % name)
    ep = [a for kw, a in final["ins"] if kw == "ENTRYPOINT"]
    if not ep or "qtxd" not in ep[-1]:
        errors.append("%s: the runtime stage's ENTRYPOINT does not run qtxd" % name)
    if cuda:
        if not re.match(r"nvidia/cuda:.*-devel", build["image"]):
            errors.append("%s: build stage must be nvidia/cuda *-devel (is %s)" % (name, build["image"]))
        if not re.match(r"nvidia/cuda:.*-runtime", final["image"]):
            errors.append("%s: runtime stage must be nvidia/cuda *-runtime (is %s)" % (name, final["image"]))
    return errors


def check_build_script(repo=REPO):
    text = open(os.path.join(repo, "docker", "build.sh")).read()
    return ["docker/build.sh does not call %s" % s
            for s in ("scripts/install_deps.sh", "deploy/bundle/make_bundle.sh") if s not in text]


def self_test():
    """Each broken variant of Dockerfile.cpu must be rejected."""
    good = open(os.path.join(REPO, "docker", "Dockerfile.cpu")).read()
    variants = {
        "root user": good.replace("USER 10001:10001", "USER root"),
        "no USER": good.replace("USER 10001:10001", ""),
        "no HEALTHCHECK": re.sub(r"HEALTHCHECK[^\n]*\\\n[^\n]*\n", "", good),
        "missing COPY source": good.replace("COPY . ./", "COPY nonexistent/ ./"),
        "bad --from": good.replace("--from=build", "--from=builder"),
        "no build script": good.replace("docker/build.sh", "make"),
        "single stage": good.split("# Runtime stage")[0],
    }
    failures = 0
    for what, text in variants.items():
        if text == good or not check(text, what):
            print("self-test: '%s' was accepted" % what)
            failures += 1
    if check(good, "Dockerfile.cpu"):
        failures += 1
    print("%d passed, %d failed" % (len(variants) + 1 - failures, failures))
    return failures == 0


def main():
    if "--self-test" in sys.argv:
        return 0 if self_test() else 1
    errors = check_build_script()
    for name, cuda in (("Dockerfile.cpu", False), ("Dockerfile.cuda", True)):
        errs = check(open(os.path.join(REPO, "docker", name)).read(), name, cuda=cuda)
        print("%s: %s" % (name, "ok" if not errs else "%d problems" % len(errs)))
        errors += errs
    for e in errors:
        print("  " + e)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
