#include "kernels/cuda/gemm.h"

#include <dlfcn.h>
#include <fmt/format.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "kernels/cuda/cuda_check.h"

namespace trainer::cuda {
namespace {

// cuBLASLt, loaded when the first GEMM plan is made rather than linked: its static
// initialisation costs about a third of a second of CPU in every process that links it, which
// every CPU-only run (and every test) would pay for a library it never calls.
struct LtApi {
// clang-format off
#define TRAINER_LT_FUNCTIONS(X)                                                         \
  X(GetStatusString) X(Create) X(Destroy)                                               \
  X(MatmulDescCreate) X(MatmulDescDestroy) X(MatmulDescSetAttribute)                    \
  X(MatrixLayoutCreate) X(MatrixLayoutDestroy) X(MatrixLayoutSetAttribute)              \
  X(MatmulPreferenceCreate) X(MatmulPreferenceDestroy) X(MatmulPreferenceSetAttribute)  \
  X(MatmulAlgoGetHeuristic) X(Matmul)
// clang-format on
#define TRAINER_LT_MEMBER(name) decltype(&::cublasLt##name) name = nullptr;
  TRAINER_LT_FUNCTIONS(TRAINER_LT_MEMBER)
#undef TRAINER_LT_MEMBER
};

const LtApi& lt() {
  static const LtApi api = [] {
    const std::string soname = "libcublasLt.so." + std::to_string(CUBLAS_VER_MAJOR);
    void* lib = dlopen(soname.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!lib)
      throw std::runtime_error("the CUDA backend's GEMMs need " + soname + ": " + dlerror());
    LtApi a;
    auto resolve = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
      if (!fn) throw std::runtime_error(soname + " has no " + name);
    };
#define TRAINER_LT_RESOLVE(name) resolve(a.name, "cublasLt" #name);
    TRAINER_LT_FUNCTIONS(TRAINER_LT_RESOLVE)
#undef TRAINER_LT_RESOLVE
#undef TRAINER_LT_FUNCTIONS
    return a;
  }();
  return api;
}

void check_lt(cublasStatus_t status, const char* call, const char* file, int line) {
  if (status != CUBLAS_STATUS_SUCCESS) fail(lt().GetStatusString(status), call, file, line);
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
  LT_CHECK(lt().MatmulDescSetAttribute(d, attr, &value, sizeof(value)));
}

}  // namespace

std::string load_cublaslt() {
  lt();
  return "libcublasLt.so." + std::to_string(CUBLAS_VER_MAJOR);
}

struct Gemm::Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool ran = false;  // a matmul with this plan has been enqueued
  ~Plan() {
    for (cublasLtMatrixLayout_t l : {a, b, c})
      if (l) lt().MatrixLayoutDestroy(l);
    if (desc) lt().MatmulDescDestroy(desc);
  }
};

Gemm::Gemm(cudaStream_t stream, void* workspace, size_t workspace_bytes)
    : stream_(stream), workspace_(workspace), workspace_bytes_(workspace_bytes) {
  LT_CHECK(lt().Create(&handle_));
}

Gemm::~Gemm() {
  plans_.clear();
  if (handle_) lt().Destroy(handle_);
}

Gemm::Key Gemm::key_of(const GemmCall& c) {
  const int batch = c.batch;
  const bool aux = c.epilogue != GemmEpilogue::none;
  return {c.trans_a,
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
          c.beta != 0.0f,
          int(c.epilogue),
          aux ? c.aux.ld : 0,
          aux ? int(c.aux.p.dtype) : -1,
          aux ? alignment(c.aux, 1) : 0};
}

Gemm::Plan* Gemm::plan(const Key& key, const GemmCall& c) {
  const bool trans_a = c.trans_a, trans_b = c.trans_b;
  const int m = c.m, n = c.n, k = c.k, batch = c.batch;
  const GemmOperand &A = c.A, &B = c.B, &C = c.C;
  const DPtr bias = c.bias;
  auto it = plans_.find(key);
  if (it != plans_.end()) return it->second.get();
  auto p = std::make_unique<Plan>();
  LT_CHECK(lt().MatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t tb = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  set(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, ta);
  set(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, tb);
  cublasLtEpilogue_t epilogue = bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
  if (c.epilogue == GemmEpilogue::gelu)
    epilogue = bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
  if (c.epilogue == GemmEpilogue::dgelu) {
    if (bias) throw std::logic_error("Gemm: the dgelu epilogue takes no bias");
    epilogue = CUBLASLT_EPILOGUE_DGELU;
  }
  set(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, epilogue);
  if (bias) {
    set(p->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, cuda_type(bias.dtype));
    set(p->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, static_cast<const void*>(bias.p));
  }
  if (c.epilogue != GemmEpilogue::none) {
    if (batch != 1) throw std::logic_error("Gemm: GELU epilogues are for batch 1");
    set(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, int64_t(c.aux.ld));
    set(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, static_cast<void*>(c.aux.p.p));
  }
  auto layout = [&](cublasLtMatrixLayout_t* l, DType t, int rows, int cols, const GemmOperand& op) {
    LT_CHECK(lt().MatrixLayoutCreate(l, cuda_type(t), uint64_t(rows), uint64_t(cols), op.ld));
    if (batch > 1) {
      LT_CHECK(lt().MatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batch,
                                             sizeof(batch)));
      LT_CHECK(lt().MatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                             &op.stride, sizeof(op.stride)));
    }
  };
  // Stored shapes: op(A) is m x k, so A is stored k x m when transposed.
  layout(&p->a, A.p.dtype, trans_a ? k : m, trans_a ? m : k, A);
  layout(&p->b, B.p.dtype, trans_b ? n : k, trans_b ? k : n, B);
  layout(&p->c, C.p.dtype, m, n, C);

  cublasLtMatmulPreference_t pref;
  LT_CHECK(lt().MatmulPreferenceCreate(&pref));
  const uint64_t ws = workspace_bytes_;
  LT_CHECK(lt().MatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                             sizeof(ws)));
  const uint32_t align_a = alignment(A, batch), align_b = alignment(B, batch),
                 align_c = alignment(C, batch);
  LT_CHECK(lt().MatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                                             &align_a, sizeof(align_a)));
  LT_CHECK(lt().MatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                             &align_b, sizeof(align_b)));
  LT_CHECK(lt().MatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                                             &align_c, sizeof(align_c)));
  LT_CHECK(lt().MatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                                             &align_c, sizeof(align_c)));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t status = lt().MatmulAlgoGetHeuristic(handle_, p->desc, p->a, p->b, p->c,
                                                            p->c, pref, 1, &result, &found);
  lt().MatmulPreferenceDestroy(pref);
  if (status == CUBLAS_STATUS_SUCCESS && found > 0)
    p->algo = result.algo;
  else
    p.reset();  // remembered: this shape has no algorithm
  return plans_.emplace(key, std::move(p)).first->second.get();
}

void Gemm::no_algorithm(const GemmCall& c) {
  throw std::runtime_error(fmt::format(
      "cuBLASLt has no algorithm for {}x{}x{} (transa {}, transb {}, batch {}, {} x {} -> {}, "
      "beta {}, bias {}, epilogue {}; or it refused the one its heuristic chose)",
      c.m, c.n, c.k, c.trans_a, c.trans_b, c.batch, dtype_name(c.A.p.dtype),
      dtype_name(c.B.p.dtype), dtype_name(c.C.p.dtype), c.beta, bool(c.bias), int(c.epilogue)));
}

cublasStatus_t Gemm::enqueue(Plan& p, const GemmCall& c) {
  // Pointers are not part of the key: set the ones the descriptor holds for this call.
  if (c.bias) set(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, static_cast<const void*>(c.bias.p));
  if (c.epilogue != GemmEpilogue::none)
    set(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, static_cast<void*>(c.aux.p.p));
  return lt().Matmul(handle_, p.desc, &c.alpha, c.A.p.p, p.a, c.B.p.p, p.b, &c.beta, c.C.p.p, p.c,
                     c.C.p.p, p.c, &p.algo, workspace_, workspace_bytes_, stream_);
}

bool Gemm::try_run(const GemmCall& c) {
  if (c.A.p.dtype != c.B.p.dtype) throw std::invalid_argument("Gemm: A and B must have one dtype");
  const bool fused = c.epilogue != GemmEpilogue::none;
  // cuBLASLt's documented needs of the auxiliary matrix: 16-byte aligned, ld a multiple of 8,
  // and (its type left at the default) the output's type.
  if (fused && (alignment(c.aux, 1) < 16 || c.aux.ld % 8 != 0 || c.aux.p.dtype != c.C.p.dtype))
    return false;
  const Key key = key_of(c);
  Plan* p = plan(key, c);
  if (!p) return false;
  const cublasStatus_t status = enqueue(*p, c);
  // A fused epilogue the heuristic offered but the matmul refuses (it validates before it
  // enqueues anything) is remembered as unavailable, like one the heuristic did not offer.
  if (fused && !p->ran &&
      (status == CUBLAS_STATUS_NOT_SUPPORTED || status == CUBLAS_STATUS_INVALID_VALUE)) {
    plans_[key].reset();
    return false;
  }
  LT_CHECK(status);
  p->ran = true;
  return true;
}

void Gemm::run(const GemmCall& c) {
  if (!try_run(c)) no_algorithm(c);
}

}  // namespace trainer::cuda
