#include "kernels/cuda/gemm.h"

#include <fmt/format.h>

#include <algorithm>
#include <stdexcept>

#include "kernels/cuda/cuda_check.h"

namespace trainer::cuda {
namespace {

void check_lt(cublasStatus_t status, const char* call, const char* file, int line) {
  if (status != CUBLAS_STATUS_SUCCESS) fail(cublasLtGetStatusString(status), call, file, line);
}
#define LT_CHECK(call) check_lt((call), #call, __FILE__, __LINE__)

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::f32:
      return CUDA_R_32F;
    case DType::bf16:
      return CUDA_R_16BF;
    case DType::f16:
      return CUDA_R_16F;
    default:
      throw std::invalid_argument("cuBLASLt: unsupported dtype " + std::string(dtype_name(t)));
  }
}

// The largest power of two (at most 256) dividing the address: the alignment the algorithm may
// assume. Part of the plan's key, since strided views of one buffer differ in it.
int alignment(uint64_t a) {
  return a == 0 ? 256 : int(std::min<uint64_t>(256, a & (~a + 1)));
}
int alignment(const void* p) {
  return alignment(reinterpret_cast<uintptr_t>(p));
}
// Every matrix of a strided batch, and every column, starts at this alignment.
int alignment(const GemmOperand& op, int batch) {
  const uint64_t size = dtype_size(op.p.dtype);
  int a = std::min(alignment(op.p.p), alignment(uint64_t(op.ld) * size));
  if (batch > 1) a = std::min(a, alignment(uint64_t(op.stride) * size));
  return a;
}

template <class V>
void set(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr, const V& value) {
  LT_CHECK(cublasLtMatmulDescSetAttribute(d, attr, &value, sizeof(value)));
}

}  // namespace

struct Gemm::Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  ~Plan() {
    for (cublasLtMatrixLayout_t l : {a, b, c})
      if (l) cublasLtMatrixLayoutDestroy(l);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

Gemm::Gemm(cudaStream_t stream, void* workspace, size_t workspace_bytes)
    : stream_(stream), workspace_(workspace), workspace_bytes_(workspace_bytes) {
  LT_CHECK(cublasLtCreate(&handle_));
}

Gemm::~Gemm() {
  plans_.clear();
  if (handle_) cublasLtDestroy(handle_);
}

Gemm::Plan& Gemm::plan(const Key& key, const GemmCall& c) {
  const bool trans_a = c.trans_a, trans_b = c.trans_b;
  const int m = c.m, n = c.n, k = c.k, batch = c.batch;
  const GemmOperand &A = c.A, &B = c.B, &C = c.C;
  const DPtr bias = c.bias;
  auto it = plans_.find(key);
  if (it != plans_.end()) return *it->second;
  auto p = std::make_unique<Plan>();
  LT_CHECK(cublasLtMatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t tb = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  set(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, ta);
  set(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, tb);
  if (bias) {
    set(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, CUBLASLT_EPILOGUE_BIAS);
    set(p->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, cuda_type(bias.dtype));
    set(p->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, static_cast<const void*>(bias.p));
  }
  auto layout = [&](cublasLtMatrixLayout_t* l, DType t, int rows, int cols, const GemmOperand& op) {
    LT_CHECK(cublasLtMatrixLayoutCreate(l, cuda_type(t), uint64_t(rows), uint64_t(cols), op.ld));
    if (batch > 1) {
      LT_CHECK(cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batch,
                                                sizeof(batch)));
      LT_CHECK(cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                                &op.stride, sizeof(op.stride)));
    }
  };
  // Stored shapes: op(A) is m x k, so A is stored k x m when transposed.
  layout(&p->a, A.p.dtype, trans_a ? k : m, trans_a ? m : k, A);
  layout(&p->b, B.p.dtype, trans_b ? n : k, trans_b ? k : n, B);
  layout(&p->c, C.p.dtype, m, n, C);

  cublasLtMatmulPreference_t pref;
  LT_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t ws = workspace_bytes_;
  LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                                sizeof(ws)));
  const uint32_t align_a = alignment(A, batch), align_b = alignment(B, batch),
                 align_c = alignment(C, batch);
  LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                                                &align_a, sizeof(align_a)));
  LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                                &align_b, sizeof(align_b)));
  LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                                                &align_c, sizeof(align_c)));
  LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                                                &align_c, sizeof(align_c)));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(handle_, p->desc, p->a, p->b, p->c,
                                                               p->c, pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (status != CUBLAS_STATUS_SUCCESS || found == 0)
    throw std::runtime_error(fmt::format(
        "cuBLASLt has no algorithm for {}x{}x{} (transa {}, transb {}, batch {}, {} x {} -> {}, "
        "beta {}, bias {}): {}",
        m, n, k, trans_a, trans_b, batch, dtype_name(A.p.dtype), dtype_name(B.p.dtype),
        dtype_name(C.p.dtype), c.beta, bool(bias), cublasLtGetStatusString(status)));
  p->algo = result.algo;
  return *plans_.emplace(key, std::move(p)).first->second;
}

void Gemm::run(const GemmCall& c) {
  if (c.A.p.dtype != c.B.p.dtype) throw std::invalid_argument("Gemm: A and B must have one dtype");
  const int batch = c.batch;
  const Key key{c.trans_a,
                c.trans_b,
                c.m,
                c.n,
                c.k,
                c.A.ld,
                c.B.ld,
                c.C.ld,
                batch > 1 ? c.A.stride : 0,
                batch > 1 ? c.B.stride : 0,
                batch > 1 ? c.C.stride : 0,
                batch,
                int(c.A.p.dtype),
                int(c.C.p.dtype),
                c.bias ? int(c.bias.dtype) : -1,
                alignment(c.A, batch),
                alignment(c.B, batch),
                alignment(c.C, batch),
                c.bias ? alignment(c.bias.p) : 0,
                c.beta != 0.0f};
  Plan& p = plan(key, c);
  if (c.bias) set(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, static_cast<const void*>(c.bias.p));
  LT_CHECK(cublasLtMatmul(handle_, p.desc, &c.alpha, c.A.p.p, p.a, c.B.p.p, p.b, &c.beta, c.C.p.p,
                          p.c, c.C.p.p, p.c, &p.algo, workspace_, workspace_bytes_, stream_));
}

}  // namespace trainer::cuda
