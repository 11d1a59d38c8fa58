#!/usr/bin/env python3
"""check_layers.py against a small tree of its own with one violation of each kind it must
catch (a relative include of another component, an angle-bracket include of a forbidden one, a
forbidden link hidden in a generator expression, a target without a rule), and the same tree
without them, which must pass."""
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
RULES = """include a: a
include b: a b
never liba: libb
never libb: CUDA::
"""


def tree(root, bad):
    def w(rel, text):
        p = os.path.join(root, rel)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        open(p, 'w').write(text)
    w('a/x.h', '#pragma once\n')
    w('b/y.h', '#pragma once\n')
    w('b/y.cc', '#include "a/x.h"\n#include "y.h"\n')
    w('a/x.cc', '#include "a/x.h"\n' + ('#include "../b/y.h"\n#include <b/y.h>\n' if bad else ''))
    w('a/CMakeLists.txt', 'add_library(liba x.cc)\n' + (
        'target_link_libraries(liba PRIVATE $<$<CONFIG:Debug>:libb>)\nadd_executable(norule x.cc)\n'
        if bad else 'target_link_libraries(liba PRIVATE foo)\n'))
    w('b/CMakeLists.txt', 'add_library(libb y.cc)\ntarget_link_libraries(libb PUBLIC bar)\n')
    w('rules.txt', RULES)


def run(root):
    return subprocess.run([sys.executable, os.path.join(HERE, 'check_layers.py'), '--root', root,
                           '--rules', os.path.join(root, 'rules.txt')],
                          capture_output=True, text=True)


def main():
    with tempfile.TemporaryDirectory() as good, tempfile.TemporaryDirectory() as bad:
        tree(good, False)
        tree(bad, True)
        g = run(good)
        if g.returncode != 0:
            print(g.stdout, g.stderr)
            return 'the clean tree failed'
        b = run(bad)
        want = ['relative include ../b/y.h', 'a must not include b/y.h', 'liba links libb',
                'target norule']
        missing = [x for x in want if x not in b.stdout]
        if b.returncode == 0 or missing:
            print(b.stdout, b.stderr)
            return f'not caught: {missing}'
    print('check_layers catches relative and angle-bracket includes, generator-expression '
          'links and targets without a rule')
    return 0


if __name__ == '__main__':
    sys.exit(main())
