// llama.cpp's own greedy decoding loop, as examples/simple/simple.cpp writes it, with the thread count and
// KV cache type that prove-local's `ar` uses, for the per-token overhead comparison of issue 20 (docs/bench.md,
// "Host cost per cycle"). Prefill the prompt, then n times: greedy sampler chain on the last row
// (llama_sampler_sample: llama.cpp's host sampling) and a one-token llama_decode; it does not stop at an
// end-of-generation token, so every run decodes exactly n tokens. Prints "decoded N tokens in S seconds"
// and the seconds spent inside llama_decode.
//
// Build against the vendored llama.cpp built as in docs/planner.md (the llama.cpp peer):
//   g++ -O2 -std=c++17 dev/ar_loop.cpp -I$LL/include -I$LL/ggml/include \
//       $LL/build/src/libllama.a $LL/build/ggml/src/libggml.a $LL/build/ggml/src/libggml-cpu.a \
//       $LL/build/ggml/src/libggml-base.a -fopenmp -lpthread -o ar_loop
//   ./ar_loop -m MODEL.gguf -t 1 -ctk f32 -n 256 [-c N_CTX -b N_BATCH] -p "prompt text"
#include "llama.h"

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

static ggml_type kv_type(const std::string & s) {
    if (s == "f32") return GGML_TYPE_F32;
    if (s == "q8_0") return GGML_TYPE_Q8_0;
    return GGML_TYPE_F16;
}

int main(int argc, char ** argv) {
    std::string model_path, prompt = "Hello", ctk = "f16";
    int n_predict = 256, n_threads = 1, n_ctx = 0, n_batch = 0;     // 0: what the prompt needs
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "-m")) model_path = argv[i + 1];
        else if (!strcmp(argv[i], "-p")) prompt = argv[i + 1];
        else if (!strcmp(argv[i], "-n")) n_predict = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "-t")) n_threads = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "-ctk")) ctk = argv[i + 1];
        else if (!strcmp(argv[i], "-c")) n_ctx = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "-b")) n_batch = atoi(argv[i + 1]);
        else { fprintf(stderr, "unknown option %s\n", argv[i]); return 2; }
    }
    llama_log_set([](ggml_log_level, const char *, void *) {}, nullptr);
    ggml_backend_load_all();
    llama_model * model = llama_model_load_from_file(model_path.c_str(), llama_model_default_params());
    if (!model) { fprintf(stderr, "%s: could not load\n", model_path.c_str()); return 1; }
    const llama_vocab * vocab = llama_model_get_vocab(model);

    const int n_prompt = -llama_tokenize(vocab, prompt.c_str(), prompt.size(), NULL, 0, true, true);
    std::vector<llama_token> tokens(n_prompt);
    llama_tokenize(vocab, prompt.c_str(), prompt.size(), tokens.data(), tokens.size(), true, true);

    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = n_ctx ? n_ctx : n_prompt + n_predict + 8;
    cp.n_batch = cp.n_ubatch = n_batch ? n_batch : n_prompt;
    cp.n_threads = cp.n_threads_batch = n_threads;
    cp.type_k = cp.type_v = kv_type(ctk);
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;    // as prove-local's contexts (llama.cpp's default is auto)
    cp.no_perf = true;
    llama_context * ctx = llama_init_from_model(model, cp);
    llama_sampler * smpl = llama_sampler_chain_init(llama_sampler_chain_default_params());
    llama_sampler_chain_add(smpl, llama_sampler_init_greedy());

    llama_batch batch = llama_batch_get_one(tokens.data(), tokens.size());
    if (llama_decode(ctx, batch)) { fprintf(stderr, "prefill failed\n"); return 1; }
    llama_token tok;
    double in_decode = 0.0;                   // seconds inside llama_decode: the rest is the loop's host work
    const auto t0 = std::chrono::steady_clock::now();
    for (int n = 0; n < n_predict; n++) {
        tok = llama_sampler_sample(smpl, ctx, -1);
        batch = llama_batch_get_one(&tok, 1);
        const auto d0 = std::chrono::steady_clock::now();
        if (llama_decode(ctx, batch)) { fprintf(stderr, "decode failed\n"); return 1; }
        in_decode += std::chrono::duration<double>(std::chrono::steady_clock::now() - d0).count();
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    printf("decoded %d tokens in %.4f seconds, speed: %.2f t/s; %.4f seconds inside llama_decode\n",
           n_predict, s, n_predict / s, in_decode);
    llama_sampler_free(smpl);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
