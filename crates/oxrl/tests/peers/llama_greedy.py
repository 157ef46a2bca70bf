"""Greedy decoding of a GGUF file with llama.cpp itself: its C library as npm's
`@node-llama-cpp/linux-x64` ships it prebuilt (`.ci/python-env` puts it in `.venv/llama.cpp`),
driven through ctypes one token at a time.

stdin: {"libdir", "gguf", "prompts": [[ids]], "max_new_tokens"}; stdout: each prompt's new ids.
"""
import ctypes as C
import json
import sys

class Batch(C.Structure):
    _fields_ = [("n_tokens", C.c_int32), ("token", C.POINTER(C.c_int32)),
                ("embd", C.POINTER(C.c_float)), ("pos", C.POINTER(C.c_int32)),
                ("n_seq_id", C.POINTER(C.c_int32)), ("seq_id", C.c_void_p),
                ("logits", C.POINTER(C.c_int8))]

class Opaque(C.Structure):
    """llama_model_params / llama_context_params, passed through untouched: their defaults are
    returned and passed back by value (in memory on x86-64), so a buffer larger than the real
    struct carries them without knowing their layout."""

    _fields_ = [("bytes", C.c_uint8 * 1024)]

def main(libdir, gguf, prompts, n_new):
    C.CDLL(f"{libdir}/libggml-base.so", mode=C.RTLD_GLOBAL)
    ggml = C.CDLL(f"{libdir}/libggml.v0.5.0.so", mode=C.RTLD_GLOBAL)
    ggml.ggml_backend_load_all_from_path(libdir.encode())
    lib = C.CDLL(f"{libdir}/libllama.v0.5.0.so", mode=C.RTLD_GLOBAL)
    lib.llama_backend_init()
    lib.llama_model_default_params.restype = Opaque
    lib.llama_context_default_params.restype = Opaque
    lib.llama_model_load_from_file.restype = C.c_void_p
    lib.llama_model_load_from_file.argtypes = [C.c_char_p, Opaque]
    lib.llama_init_from_model.restype = C.c_void_p
    lib.llama_init_from_model.argtypes = [C.c_void_p, Opaque]
    lib.llama_batch_get_one.restype = Batch
    lib.llama_batch_get_one.argtypes = [C.POINTER(C.c_int32), C.c_int32]
    lib.llama_decode.restype = C.c_int32
    lib.llama_decode.argtypes = [C.c_void_p, Batch]
    lib.llama_get_logits_ith.restype = C.POINTER(C.c_float)
    lib.llama_get_logits_ith.argtypes = [C.c_void_p, C.c_int32]
    lib.llama_model_get_vocab.restype = C.c_void_p
    lib.llama_model_get_vocab.argtypes = [C.c_void_p]
    lib.llama_vocab_n_tokens.restype = C.c_int32
    lib.llama_vocab_n_tokens.argtypes = [C.c_void_p]
    model = lib.llama_model_load_from_file(gguf.encode(), lib.llama_model_default_params())
    assert model, f"llama.cpp could not load {gguf}"
    n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))
    lib.llama_free.argtypes = [C.c_void_p]
    lib.llama_set_n_threads.argtypes = [C.c_void_p, C.c_int32, C.c_int32]
    results = []
    for prompt_ids in prompts:
        # A fresh context per prompt: nothing cached from the previous one.
        ctx = lib.llama_init_from_model(model, lib.llama_context_default_params())
        assert ctx, "llama.cpp could not make a context"
        # One thread: the model is tiny, and idle worker threads spin on a busy machine.
        lib.llama_set_n_threads(ctx, 1, 1)
        tokens, out = list(prompt_ids), []
        for _ in range(n_new):
            arr = (C.c_int32 * len(tokens))(*tokens)
            rc = lib.llama_decode(ctx, lib.llama_batch_get_one(arr, len(tokens)))
            assert rc == 0, f"llama_decode returned {rc}"
            logits = lib.llama_get_logits_ith(ctx, -1)
            best = max(range(n_vocab), key=lambda i: logits[i])
            out.append(best)
            tokens = [best]
        lib.llama_free(ctx)
        results.append(out)
    return results


if __name__ == "__main__":
    req = json.loads(sys.stdin.read())
    print(json.dumps(main(req["libdir"], req["gguf"], req["prompts"], req["max_new_tokens"])))
