// Reference token ids from Hugging Face's own JavaScript tokenizers (npm @huggingface/tokenizers),
// for tests/model/hf_reference_test.py.
//
//   node hf_reference.mjs NODE_MODULES CASES.json FAMILY=TOKENIZER.json ...
//
// CASES.json is a JSON array of strings. Prints one JSON object: {FAMILY: [[ids of case 0], ...]}.
// Each text is encoded without post-processor tokens (add_special_tokens false) and with special-
// token text mapped to its id (the library always does that), from tokenizer.json alone (an empty
// tokenizer_config, so no option outside tokenizer.json applies).
import { readFileSync } from "node:fs";
import { createRequire } from "node:module";
import path from "node:path";

const [modules, casesPath, ...families] = process.argv.slice(2);
const require = createRequire(path.resolve(modules, "noop.js"));
const { Tokenizer } = require("@huggingface/tokenizers");
const cases = JSON.parse(readFileSync(casesPath, "utf8"));
const out = {};
for (const spec of families) {
  const eq = spec.indexOf("=");
  const family = spec.slice(0, eq);
  const json = JSON.parse(readFileSync(spec.slice(eq + 1), "utf8"));
  const tok = new Tokenizer(json, {});
  out[family] = cases.map((text) => tok.encode(text, { add_special_tokens: false }).ids);
}
process.stdout.write(JSON.stringify(out));
