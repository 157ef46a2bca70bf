// The CUDA side of logprob.rs: per-row log-probability of the target, the row's entropy, and the
// log-probability's gradient, for f32 and bf16 logits, every sum in f32. Compiled at run time by
// NVRTC (no CUDA headers: bf16 is read as its 16 bits), one block per row.
//
//   lp_i   = z_it − m_i − ln S_i                 m_i = max_j z_ij,  S_i = Σ_j exp(z_ij − m_i)
//   H_i    = ln S_i − (Σ_j exp(z_ij − m_i)·(z_ij − m_i)) / S_i
//   ∂lp_i/∂z_ij · g_i = g_i·(1[j = t_i] − exp(z_ij − lse_i)),  lse_i = z_it − lp_i

#define THREADS 256

__device__ __forceinline__ float load(const float* p, long i) { return p[i]; }

__device__ __forceinline__ float load(const unsigned short* p, long i) {
    return __uint_as_float(((unsigned int)p[i]) << 16);
}

__device__ __forceinline__ void store(float* p, long i, float x) { p[i] = x; }

// Round to nearest even, as candle's and torch's f32 → bf16 casts do (NaN kept quiet).
__device__ __forceinline__ void store(unsigned short* p, long i, float x) {
    unsigned int bits = __float_as_uint(x);
    if ((bits & 0x7fffffffu) > 0x7f800000u) {
        p[i] = (unsigned short)((bits >> 16) | 0x40u);
        return;
    }
    bits += 0x7fffu + ((bits >> 16) & 1u);
    p[i] = (unsigned short)(bits >> 16);
}

// The block's reduction of one value per thread; every thread gets the result.
template <bool IsMax>
__device__ float block_reduce(float x) {
    __shared__ float partial[THREADS / 32];
    for (int offset = 16; offset > 0; offset /= 2) {
        float other = __shfl_xor_sync(0xffffffffu, x, offset);
        x = IsMax ? fmaxf(x, other) : x + other;
    }
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if (lane == 0) partial[warp] = x;
    __syncthreads();
    x = partial[0];
    for (int w = 1; w < THREADS / 32; ++w) x = IsMax ? fmaxf(x, partial[w]) : x + partial[w];
    __syncthreads();
    return x;
}

template <typename T>
__device__ void logprob_entropy(const T* logits, const unsigned int* targets, float* lp,
                                float* entropy, int vocab, int with_entropy) {
    long row = blockIdx.x;
    const T* z = logits + row * (long)vocab;
    float m = __int_as_float(0xff800000);  // −∞
    for (int j = threadIdx.x; j < vocab; j += THREADS) m = fmaxf(m, load(z, j));
    m = block_reduce<true>(m);
    float s = 0.0f, dot = 0.0f;
    for (int j = threadIdx.x; j < vocab; j += THREADS) {
        float shifted = load(z, j) - m;
        float e = expf(shifted);
        s += e;
        dot += e * shifted;
    }
    s = block_reduce<false>(s);
    if (with_entropy) dot = block_reduce<false>(dot);
    if (threadIdx.x == 0) {
        float ln_s = logf(s);
        lp[row] = load(z, targets[row]) - m - ln_s;
        if (with_entropy) entropy[row] = ln_s - dot / s;
    }
}

template <typename T>
__device__ void logprob_grad(const T* logits, const unsigned int* targets, const float* lp,
                             const float* grad_lp, T* grad, int vocab) {
    long row = blockIdx.x;
    const T* z = logits + row * (long)vocab;
    T* out = grad + row * (long)vocab;
    unsigned int t = targets[row];
    float g = grad_lp[row];
    float lse = load(z, t) - lp[row];
    for (int j = threadIdx.x; j < vocab; j += THREADS) {
        float d = -g * expf(load(z, j) - lse);
        store(out, j, j == (int)t ? d + g : d);
    }
}

extern "C" __global__ void logprob_entropy_f32(const float* logits, const unsigned int* targets,
                                               float* lp, float* entropy, int vocab,
                                               int with_entropy) {
    logprob_entropy(logits, targets, lp, entropy, vocab, with_entropy);
}

extern "C" __global__ void logprob_entropy_bf16(const unsigned short* logits,
                                                const unsigned int* targets, float* lp,
                                                float* entropy, int vocab, int with_entropy) {
    logprob_entropy(logits, targets, lp, entropy, vocab, with_entropy);
}

extern "C" __global__ void logprob_grad_f32(const float* logits, const unsigned int* targets,
                                            const float* lp, const float* grad_lp, float* grad,
                                            int vocab) {
    logprob_grad(logits, targets, lp, grad_lp, grad, vocab);
}

extern "C" __global__ void logprob_grad_bf16(const unsigned short* logits,
                                             const unsigned int* targets, const float* lp,
                                             const float* grad_lp, unsigned short* grad,
                                             int vocab) {
    logprob_grad(logits, targets, lp, grad_lp, grad, vocab);
}
