#!/usr/bin/python3
"""Reference renderer for tests/model/chat_template_test.cc: renders chat templates with Python's
jinja2 in the environment Hugging Face transformers uses for apply_chat_template (sandboxed,
trim_blocks, lstrip_blocks, loopcontrols, raise_exception, strftime_now, tojson keeping
non-ASCII).

Input (argv[1]): a JSON list of {"template": text, "context": {variables}}.
Output (stdout): a JSON list of {"ok": true, "text": ...} or {"ok": false, "error": message}.
"""
import json
import sys
from datetime import datetime

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def strftime_now(format):
    return datetime.now().strftime(format)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def main():
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    with open(sys.argv[1], encoding="utf-8") as f:
        cases = json.load(f)
    out = []
    for case in cases:
        try:
            text = env.from_string(case["template"]).render(**case["context"])
            out.append({"ok": True, "text": text})
        except Exception as e:  # noqa: BLE001 - any failure is an expected "error" outcome
            out.append({"ok": False, "error": f"{type(e).__name__}: {e}"})
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
