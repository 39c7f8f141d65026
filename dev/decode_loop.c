// The plainest greedy loop over llama_decode, for dev/decode_floor.py: n one-token passes from position
// pos0, each fed the argmax of the row before (first maximum), with llama_synchronize after each decode
// as prove-local's llama.decode does. Built by decode_floor.py against the llama_cpp package's own
// libllama (the one prove-local runs) and called through ctypes, so that the loop runs inside a Python
// process without any Python between its passes. Returns the last token, or -1 when a decode fails.
#include "llama.h"

int decode_loop(struct llama_context * ctx, int tok, int pos0, int n, int n_vocab) {
    llama_batch b = llama_batch_init(1, 0, 1);
    for (int i = 0; i < n; i++) {
        b.n_tokens = 1;
        b.token[0] = tok;
        b.pos[0] = pos0 + i;
        b.n_seq_id[0] = 1;
        b.seq_id[0][0] = 0;
        b.logits[0] = 1;
        if (llama_decode(ctx, b) != 0) {
            llama_batch_free(b);
            return -1;
        }
        llama_synchronize(ctx);
        const float * row = llama_get_logits_ith(ctx, -1);
        int best = 0;
        for (int j = 1; j < n_vocab; j++) {
            if (row[j] > row[best]) best = j;
        }
        tok = best;
    }
    llama_batch_free(b);
    return tok;
}
