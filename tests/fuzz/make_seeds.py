#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets (tests/fuzz/corpus/<target>/): tiny valid inputs,
committed; rerun after a format change. Files found by fuzzing (crashes turned into regression
inputs) live beside them as regress-*. Needs protoc (for the request seeds)."""
import json
import os
import struct
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
OUT = os.path.join(HERE, "corpus")


def put(target, name, data):
    d = os.path.join(OUT, target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def floats(n, scale=0.01, fmt="f32"):
    vals = [((i * 37) % 17 - 8) * scale for i in range(n)]
    if fmt == "f32":
        return struct.pack("<%df" % n, *vals)
    if fmt == "f16":
        return struct.pack("<%de" % n, *vals)
    # bf16: the high half of the f32
    return b"".join(struct.pack("<f", v)[2:] for v in vals)


# ---- GGUF ----
U32, I32, F32, BOOL, STRING, ARRAY, U64 = 4, 5, 6, 7, 8, 9, 10


def gstr(s):
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def gval(t, v):
    if t == U32:
        return struct.pack("<I", v)
    if t == I32:
        return struct.pack("<i", v)
    if t == F32:
        return struct.pack("<f", v)
    if t == BOOL:
        return struct.pack("<B", v)
    if t == U64:
        return struct.pack("<Q", v)
    if t == STRING:
        return gstr(v)
    et, items = v
    return struct.pack("<IQ", et, len(items)) + b"".join(gval(et, x) for x in items)


def gguf(kv, tensors, alignment=32):
    """kv: [(key, type, value)]; tensors: [(name, torch_shape, ggml_type, bytes)]."""
    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kv))
    for k, t, v in kv:
        out += gstr(k) + struct.pack("<I", t) + gval(t, v)
    offset, blobs = 0, []
    for name, shape, gt, data in tensors:
        out += gstr(name) + struct.pack("<I", len(shape))
        out += b"".join(struct.pack("<Q", d) for d in reversed(shape))
        out += struct.pack("<IQ", gt, offset)
        pad = (-len(data)) % alignment
        blobs.append(data + b"\0" * pad)
        offset += len(data) + pad
    out += b"\0" * ((-len(out)) % alignment)
    return out + b"".join(blobs)


DIM, FFN, HEADS = 4, 8, 1


def spm_vocab():
    pieces = ["<unk>", "<s>", "</s>"] + ["<0x%02X>" % b for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    extra = ["\u2581", "\u2581a", "a", "b", "\u2581Once", "\u2581upon", "\u2581t", "ime", "<|im_end|>"]
    pieces += extra
    types += [1] * (len(extra) - 1) + [3]
    scores = [0.0] * 259 + [-float(i) for i in range(len(extra))]
    return pieces, types, scores


def gguf_model(gt=0, tied=False, chat=False, layers=1):
    pieces, types, scores = spm_vocab()
    vocab = len(pieces)
    fmt = {0: "f32", 1: "f16", 30: "bf16"}[gt]
    kv = [("general.architecture", STRING, "llama"),
          ("llama.embedding_length", U32, DIM), ("llama.feed_forward_length", U32, FFN),
          ("llama.block_count", U32, layers), ("llama.attention.head_count", U32, HEADS),
          ("llama.attention.head_count_kv", U32, HEADS), ("llama.context_length", U32, 128),
          ("llama.attention.layer_norm_rms_epsilon", F32, 1e-5),
          ("llama.rope.freq_base", F32, 10000.0), ("llama.rope.dimension_count", U32, DIM // HEADS),
          ("tokenizer.ggml.model", STRING, "llama"),
          ("tokenizer.ggml.tokens", ARRAY, (STRING, pieces)),
          ("tokenizer.ggml.scores", ARRAY, (F32, scores)),
          ("tokenizer.ggml.token_type", ARRAY, (I32, types)),
          ("tokenizer.ggml.bos_token_id", U32, 1), ("tokenizer.ggml.eos_token_id", U32, 2),
          ("tokenizer.ggml.unknown_token_id", U32, 0),
          ("tokenizer.ggml.add_space_prefix", BOOL, 1)]
    if chat:
        kv.append(("tokenizer.chat_template", STRING,
                   "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|im_end|>"
                   "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"))
    def t(name, shape):
        n = 1
        for d in shape:
            n *= d
        return (name, shape, gt, floats(n, fmt=fmt))
    ts = [t("token_embd.weight", [vocab, DIM]), t("output_norm.weight", [DIM])]
    if not tied:
        ts.append(t("output.weight", [vocab, DIM]))
    for i in range(layers):
        p = "blk.%d." % i
        ts += [t(p + "attn_norm.weight", [DIM]), t(p + "attn_q.weight", [DIM, DIM]),
               t(p + "attn_k.weight", [DIM, DIM]), t(p + "attn_v.weight", [DIM, DIM]),
               t(p + "attn_output.weight", [DIM, DIM]), t(p + "ffn_norm.weight", [DIM]),
               t(p + "ffn_gate.weight", [FFN, DIM]), t(p + "ffn_up.weight", [FFN, DIM]),
               t(p + "ffn_down.weight", [DIM, FFN])]
    return gguf(kv, ts)


# ---- safetensors (the model of hf_fixture.h: vocabulary 256) ----
def hf_tensors(layers=1):
    ts = [("model.embed_tokens.weight", [256, DIM]), ("model.norm.weight", [DIM]),
          ("lm_head.weight", [256, DIM])]
    for i in range(layers):
        p = "model.layers.%d." % i
        ts += [(p + "input_layernorm.weight", [DIM]), (p + "self_attn.q_proj.weight", [DIM, DIM]),
               (p + "self_attn.k_proj.weight", [DIM, DIM]), (p + "self_attn.v_proj.weight", [DIM, DIM]),
               (p + "self_attn.o_proj.weight", [DIM, DIM]),
               (p + "post_attention_layernorm.weight", [DIM]),
               (p + "mlp.gate_proj.weight", [FFN, DIM]), (p + "mlp.up_proj.weight", [FFN, DIM]),
               (p + "mlp.down_proj.weight", [DIM, FFN])]
    return ts


def safetensors(ts, dtype="F32"):
    header, data = {"__metadata__": {"format": "pt"}}, b""
    for name, shape in ts:
        n = 1
        for d in shape:
            n *= d
        blob = floats(n, fmt={"F32": "f32", "F16": "f16", "BF16": "bf16"}[dtype])
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(blob)]}
        data += blob
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((-len(h)) % 8)
    return struct.pack("<Q", len(h)) + h + data


# ---- tokenizer.json ----
def byte_char(b):
    ok = lambda x: 33 <= x <= 126 or 161 <= x <= 172 or 174 <= x <= 255
    if ok(b):
        return chr(b)
    return chr(256 + sum(1 for x in range(b) if not ok(x)))


def tokenizer_json(llama3):
    vocab = {byte_char(b): b for b in range(256)}
    merges_raw = [(" ", "t"), ("h", "e"), (" t", "he"), ("1", "2"), ("l", "l"), ("he", "ll"),
                  ("hell", "o"), (" ", "w"), ("o", "r"), (" w", "or")]
    bl = lambda s: "".join(byte_char(c) for c in s.encode())
    merges = []
    for k, (l, r) in enumerate(merges_raw):
        vocab[bl(l) + bl(r)] = 256 + k
        merges.append(bl(l) + " " + bl(r) if llama3 else [bl(l), bl(r)])
    n = 256 + len(merges_raw)
    j = {"version": "1.0", "normalizer": None, "decoder": {"type": "ByteLevel"},
         "model": {"type": "BPE", "vocab": vocab, "merges": merges, "ignore_merges": llama3},
         "added_tokens": [{"id": n, "content": "<|begin_of_text|>", "special": True},
                          {"id": n + 1, "content": "<|eot_id|>", "special": True},
                          {"id": n + 2, "content": "<tool>", "special": False}]}
    if llama3:
        regex = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
        j["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
            {"type": "Digits", "individual_digits": True},
            {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}]}
        j["post_processor"] = {"type": "TemplateProcessing", "single": [
            {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}}]}
    else:
        j["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": True}
    return json.dumps(j, ensure_ascii=False)


def tokenizer_json_components():
    """A BPE over characters with byte fallback and most normalizers, pre-tokenizers and
    decoders: the fuzzer's start for the component readers."""
    sp = "\u2581"
    chars = [sp, "a", "b", "c", "1", "2", ".", "<unk>"] + ["<0x%02X>" % b for b in range(256)]
    vocab = {c: i for i, c in enumerate(chars)}
    merges = [[sp, "a"], [sp + "a", "b"], ["1", "2"]]
    for l, r in merges:
        vocab[l + r] = len(vocab)
    n = len(vocab)
    j = {"version": "1.0",
         "normalizer": {"type": "Sequence", "normalizers": [
             {"type": "NFKC"}, {"type": "Lowercase"}, {"type": "StripAccents"},
             {"type": "Replace", "pattern": {"Regex": "[0-9]{4,}"}, "content": "12"},
             {"type": "Strip", "strip_left": True, "strip_right": False},
             {"type": "Prepend", "prepend": sp},
             {"type": "BertNormalizer", "clean_text": True, "handle_chinese_chars": True,
              "strip_accents": None, "lowercase": False}]},
         "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
             {"type": "Metaspace", "replacement": sp, "prepend_scheme": "first", "split": True},
             {"type": "Punctuation", "behavior": "Contiguous"},
             {"type": "Digits", "individual_digits": False},
             {"type": "Split", "pattern": {"String": "c"}, "behavior": "MergedWithNext",
              "invert": True}]},
         "decoder": {"type": "Sequence", "decoders": [
             {"type": "Replace", "pattern": {"String": sp}, "content": " "},
             {"type": "ByteFallback"}, {"type": "Fuse"},
             {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
         "model": {"type": "BPE", "vocab": vocab, "merges": merges, "unk_token": "<unk>",
                   "byte_fallback": True, "fuse_unk": True, "continuing_subword_prefix": "",
                   "end_of_word_suffix": ""},
         "added_tokens": [
             {"id": n, "content": "<s>", "special": True},
             {"id": n + 1, "content": "<x>", "special": False, "lstrip": True, "rstrip": True},
             {"id": n + 2, "content": "ab", "special": False, "normalized": True}]}
    return json.dumps(j, ensure_ascii=False)


def main():
    # GGUF: F32 untied, F16 tied with a chat template, BF16 with two layers.
    put("gguf", "f32.gguf", gguf_model(0))
    put("gguf", "f16_tied_chat.gguf", gguf_model(1, tied=True, chat=True))
    put("gguf", "bf16_2layers.gguf", gguf_model(30, layers=2))

    # safetensors: one file (F32, BF16), and an index over two shards.
    ts = hf_tensors()
    put("safetensors", "single_f32.safetensors", safetensors(ts))
    put("safetensors", "single_bf16.safetensors", safetensors(ts, "BF16"))
    half = len(ts) // 2
    index = {"metadata": {"total_size": 0},
             "weight_map": {**{n: "model-00001.safetensors" for n, _ in ts[:half]},
                            **{n: "model-00002.safetensors" for n, _ in ts[half:]}}}
    put("safetensors", "index_two_shards", json.dumps(index).encode() + b"\n--shard--\n" +
        safetensors(ts[:half]) + b"\n--shard--\n" + safetensors(ts[half:], "F16"))

    # config.json [\0 tokenizer_config.json]
    base = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4,
            "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1,
            "num_key_value_heads": 1, "vocab_size": 256, "max_position_embeddings": 64,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
            "tie_word_embeddings": False}
    put("config_json", "llama", json.dumps(base))
    llama3 = dict(base, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 32},
                  tie_word_embeddings=True, head_dim=4)
    tc = {"bos_token": "<s>", "eos_token": {"content": "</s>"},
          "chat_template": "{{ bos_token }}{% for m in messages %}{% if loop.first and m.role == "
                           "'system' %}[SYS]{{ m.content | trim }}[/SYS]{% else %}<|{{ m.role }}|>"
                           "{{ m.content }}{{ eos_token }}{% endif %}{% endfor %}"
                           "{% if add_generation_prompt %}<|assistant|>{% endif %}"}
    put("config_json", "llama3_rope_chat", json.dumps(llama3) + "\0" + json.dumps(tc))
    mistral = dict(base, architectures=["MistralForCausalLM"], model_type="mistral",
                   sliding_window=None)
    tc_list = {"chat_template": [
        {"name": "default", "template": "{% for m in messages %}{{ m.role }}: {{ m.content }}\n"
                                        "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"},
        {"name": "tool_use", "template": "{{ raise_exception('no tools') }}"}]}
    put("config_json", "mistral_template_list", json.dumps(mistral) + "\0" + json.dumps(tc_list))

    # tokenizer.json \0 text
    put("tokenizer_json", "bytelevel", tokenizer_json(False) + "\0hello world 123 \u00e9\u4e2d")
    put("tokenizer_json", "components", tokenizer_json_components() +
        "\0<s>  ABC 12345 \u00e9\u00c9 \ufb01 <x> ab.c \u4e2d\u6587 \xff")
    put("tokenizer_json", "llama3", tokenizer_json(True) +
        "\0<|begin_of_text|>Hello world, it's 12345!\n\n<tool> \xf0\x9f\x99\x82<|eot_id|>")

    # OpenAI bodies: first byte = bit 0 chat, bit 1 with a chat template.
    comp = [{"prompt": "1 2 3", "max_tokens": 4, "stop": ["\n", "5 6"], "temperature": 0.5},
            {"prompt": [1, 2, 3], "top_k": 3, "top_p": 0.9, "seed": 7, "stream": True,
             "stream_options": {"include_usage": True}, "n": 1},
            {"segments": ["10 11 12", [4, 5, 6], {"text": "7 8", "cacheable": False}],
             "reuse": {"enable": True, "full_layers": 2, "recompute_ratio": 0.15,
                       "selector": "sparsex", "store_new_segments": True},
             "add_bos": False, "ignore_eos": True, "max_completion_tokens": 8}]
    for i, b in enumerate(comp):
        put("openai_codec", "completion_%d" % i, b"\x00" + json.dumps(b).encode())
    chat = {"model": "tiny", "messages": [
        {"role": "system", "content": "5 6"},
        {"role": "user", "content": [{"type": "text", "text": "1 2"}, {"type": "text", "text": "3"}]},
        {"role": "assistant", "content": "4"}, {"role": "user", "content": "9 9"}],
        "max_tokens": 5, "stop": "0", "stream": True}
    put("openai_codec", "chat_plain", b"\x01" + json.dumps(chat).encode())
    put("openai_codec", "chat_template", b"\x03" + json.dumps(chat).encode())

    # GenerateRequest wire bytes, from text format through protoc.
    texts = {
        "prompt": 'prompt: "1 2 3" sampling { temperature: 0.7 top_k: 5 top_p: 0.9 max_tokens: 8 '
                  'stop_ids: 8 seed: 3 } request_id: "r1"',
        "ids_reuse": 'prompt_ids: [7, 1, 2, 3] add_bos: false reuse { full_layers: 2 '
                     'recompute_ratio: 0.2 } return_token_ids: true',
        "segments": 'segments { text: "1 2 3" } segments { ids { ids: [4, 5, 6] } } '
                    'segments { text: "7 8" cacheable: false } sampling { max_tokens: 4 }',
    }
    for name, text in texts.items():
        try:
            b = subprocess.run(["protoc", "-I", os.path.join(ROOT, "proto"),
                                "--encode=sparsex.v1.GenerateRequest", "sparsex.proto"],
                               input=text.encode(), capture_output=True, check=True).stdout
        except subprocess.CalledProcessError as e:
            sys.exit("protoc: %s: %s" % (name, e.stderr.decode()))
        put("request", name, b)

    # KV blocks (the target recomputes both checksums): bf16, f32 and f8, 1-2 layers.
    def kv(dtype, es, lb, le, ntok, kvdim):
        payload_len = (le - lb) * 2 * ntok * kvdim * es
        h = struct.pack("<IHBBIIIIII", 0x564B5853, 1, dtype, 0, 1, lb, le, ntok, kvdim, 0)
        h += struct.pack("<QQQQ", 1, 2, 3, 4) + struct.pack("<QQ", payload_len, 0)
        h += b"\0" * 40 + struct.pack("<Q", 0)
        return h + bytes((i * 7) & 0xFF for i in range(payload_len))
    put("kv_block", "bf16", kv(3, 2, 0, 1, 2, 4))
    put("kv_block", "f32_layers_2_4", kv(1, 4, 2, 4, 1, 2))
    put("kv_block", "f8", kv(4, 1, 0, 1, 3, 8))


if __name__ == "__main__":
    main()
