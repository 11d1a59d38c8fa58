#!/usr/bin/env python3
"""Checks SparseX's layering (tests/arch/layers.txt): project #includes between folders, CMake
link dependencies between targets (transitively), and the shared libraries of built binaries.
Exits 1 listing every forbidden arrow."""
import argparse
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def load_rules(path):
    include, never, ldd = {}, {}, {}
    for raw in open(path):
        line = raw.split('#', 1)[0].strip()
        if not line:
            continue
        kind, rest = line.split(None, 1)
        lhs, rhs = rest.split(':', 1)
        vals = rhs.split()
        {'include': include, 'never': never, 'ldd': ldd}[kind][lhs.strip()] = vals
    return include, never, ldd


def component(path, folders):
    best = None
    for f in folders:
        if path == f or path.startswith(f + '/'):
            if best is None or len(f) > len(best):
                best = f
    return best


def check_includes(root, include_rules):
    errors = []
    folders = sorted(include_rules)
    top = {f.split('/')[0] for f in folders}
    # Quoted and angle-bracket includes: a project header is a project header however it is
    # spelled, and a relative path ("../router/x.h", "x.h" beside the file) is resolved first.
    inc_re = re.compile(r'^\s*#\s*include\s+[<"]([^">]+)[">]')
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        if rel_dir == '.':
            dirnames[:] = [d for d in dirnames if d in top]
            continue
        for name in filenames:
            if not name.endswith(('.h', '.cc', '.cu', '.cuh', '.hpp', '.cpp')):
                continue
            rel = os.path.normpath(os.path.join(rel_dir, name))
            src = component(rel, folders)
            if src is None:
                continue
            allowed = set(include_rules[src]) | {src}
            for n, line in enumerate(open(os.path.join(root, rel), errors='replace'), 1):
                m = inc_re.match(line)
                if not m:
                    continue
                target = m.group(1)
                beside = os.path.normpath(os.path.join(rel_dir, target))
                if (target.startswith('.') or '/' not in target) and \
                        os.path.exists(os.path.join(root, beside)):
                    if component(beside, folders) != src:
                        errors.append(f'{rel}:{n}: relative include {target} reaches {beside}: '
                                      'include another component by its path from the root')
                        continue
                    target = beside
                if target.split('/')[0] not in top and not os.path.exists(os.path.join(root, target)):
                    continue  # a system or third-party header, or generated (*.pb.h)
                dst = component(target, folders)
                if dst is None and target.startswith('proto/'):
                    dst = 'proto'  # generated proto headers
                if dst is None:
                    errors.append(f'{rel}:{n}: includes {target}, which is in no listed folder')
                    continue
                # A subfolder listed on its own (gpu_worker/service) is not part of its parent's
                # allowance: gpu_worker may not include gpu_worker/service.
                if dst not in allowed and not any(dst == a for a in allowed):
                    errors.append(f'{rel}:{n}: {src} must not include {target} ({dst})')
    return errors


def parse_cmake_links(root):
    """target -> set of directly linked items, from every target_link_libraries call."""
    links = {}
    call_re = re.compile(r'target_link_libraries\s*\(([^)]*)\)', re.S)
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(('build', '.', 'node_modules'))]
        if 'CMakeLists.txt' not in filenames:
            continue
        text = open(os.path.join(dirpath, 'CMakeLists.txt')).read()
        text = re.sub(r'#[^\n]*', '', text)
        for m in call_re.finditer(text):
            toks = m.group(1).split()
            if not toks:
                continue
            tgt = toks[0]
            if tgt.startswith('${'):
                continue  # test executables named by a loop variable
            items = set()
            for t in toks[1:]:
                if t in ('PUBLIC', 'PRIVATE', 'INTERFACE'):
                    continue
                if '$<' in t:
                    # A generator expression links what it names: $<$<CONFIG:X>:lib>,
                    # $<BUILD_INTERFACE:lib>, $<TARGET_NAME_IF_EXISTS:lib>, ...
                    for name in re.findall(r':([A-Za-z0-9_:.+-]+)>', t):
                        items.update(x for x in name.split(';') if x)
                    continue
                items.add(t)
            links.setdefault(tgt, set()).update(items)
    return links


def defined_targets(root):
    """Targets the product defines (add_library / add_executable outside tests/ and bench/)."""
    out = {}
    def_re = re.compile(r'add_(?:library|executable)\s*\(\s*([A-Za-z0-9_\-]+)')
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(('build', '.', 'node_modules'))]
        rel = os.path.relpath(dirpath, root)
        if rel.split(os.sep)[0] in ('tests', 'bench') or 'CMakeLists.txt' not in filenames:
            continue
        text = re.sub(r'#[^\n]*', '', open(os.path.join(dirpath, 'CMakeLists.txt')).read())
        for m in def_re.finditer(text):
            if not m.group(1).startswith('$'):
                out[m.group(1)] = os.path.join(rel, 'CMakeLists.txt')
    return out


def closure(links, tgt):
    seen, stack = set(), [tgt]
    while stack:
        t = stack.pop()
        for d in links.get(t, ()):
            if d not in seen:
                seen.add(d)
                stack.append(d)
    return seen


def check_links(root, never_rules):
    errors = []
    links = parse_cmake_links(root)
    defined = defined_targets(root)
    for tgt, where in sorted(defined.items()):
        if tgt not in never_rules:
            errors.append(f'target {tgt} ({where}) has no "never" rule in layers.txt')
    for tgt, banned in never_rules.items():
        if tgt not in links and tgt not in defined:
            errors.append(f'target {tgt} named in layers.txt is defined nowhere')
            continue
        reach = closure(links, tgt)
        for b in banned:
            for r in sorted(reach):
                if r == tgt:
                    continue
                if r == b or (b.endswith(('_', '::')) and r.startswith(b)) or \
                        (not b.endswith(('_', '::')) and r.startswith(b) and b.endswith('cache')):
                    if b == 'sparsex_' and r in ('sparsex_defs',):
                        continue
                    errors.append(f'{tgt} links {r} (forbidden: {b})')
    return errors


def check_ldd(build, ldd_rules):
    errors, checked = [], 0
    for binary, banned in ldd_rules.items():
        path = os.path.join(build, 'bin', binary)
        if not os.path.exists(path):
            continue
        checked += 1
        out = subprocess.run(['ldd', path], capture_output=True, text=True).stdout
        for line in out.splitlines():
            lib = line.strip().split()[0] if line.strip() else ''
            for b in banned:
                if lib.startswith(b):
                    errors.append(f'{binary} loads {lib} (forbidden: {b})')
    return errors, checked


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--root', default=os.path.dirname(os.path.dirname(HERE)))
    ap.add_argument('--build', default='')
    ap.add_argument('--rules', default=os.path.join(HERE, 'layers.txt'))
    a = ap.parse_args()
    include, never, ldd = load_rules(a.rules)
    errors = check_includes(a.root, include) + check_links(a.root, never)
    checked = 0
    if a.build:
        e, checked = check_ldd(a.build, ldd)
        errors += e
    for e in errors:
        print('LAYER VIOLATION:', e)
    print(f'{len(include)} include rules, {len(never)} link rules, {checked} binaries checked '
          f'with ldd: {len(errors)} violations')
    return 1 if errors else 0


if __name__ == '__main__':
    sys.exit(main())
