#include "gpu_worker/backend/cuda/cudnn_attention.h"

#include <dlfcn.h>

#include <array>
#include <chrono>
#include <cstdlib>
#include <limits>
#include <vector>

namespace sparsex {
namespace {

// The cuDNN 9 backend ABI (cudnn_graph.h): only the values used here. When the header is
// available they are checked against it.
using Status = int;  // cudnnStatus_t; 0 = success
using Desc = void*;  // cudnnBackendDescriptor_t
enum : int {
  // cudnnBackendDescriptorType_t
  kPointwiseDesc = 0, kEngineCfgDesc = 3, kEngineHeurDesc = 4, kExecutionPlanDesc = 5,
  kOpPointwiseDesc = 13, kOpGraphDesc = 15, kVariantPackDesc = 16, kTensorDesc = 17,
  kMatmulDesc = 18, kOpMatmulDesc = 19, kReductionDesc = 21, kOpReductionDesc = 22,
  // cudnnBackendAttributeType_t
  kTypeHandle = 0, kTypeDataType = 1, kTypeBoolean = 2, kTypeInt64 = 3, kTypeVoidPtr = 6,
  kTypeHeurMode = 8, kTypePointwiseMode = 14, kTypeBackendDescriptor = 15,
  kTypeReductionOperator = 18,
  // cudnnDataType_t
  kFloat = 0, kInt32 = 4, kBf16 = 9, kBoolean = 11,
  // cudnnPointwiseMode_t
  kPwAdd = 0, kPwMul = 1, kPwDiv = 6, kPwSub = 9, kPwExp = 13, kPwLog = 15, kPwCmpGe = 303,
  kPwGenIndex = 501, kPwBinarySelect = 601,
  // cudnnReduceTensorOp_t
  kReduceAdd = 0, kReduceMax = 3,
  // cudnnBackendHeurMode_t
  kHeurA = 3, kHeurFallback = 2,
};
// cudnnBackendAttributeName_t
enum : int {
  kAttrPointwiseMode = 0, kAttrPointwiseMathPrec = 1, kAttrPointwiseAxis = 9,
  kAttrHeurMode = 200, kAttrHeurGraph = 201, kAttrHeurResults = 202,
  kAttrPlanHandle = 400, kAttrPlanEngineConfig = 401, kAttrPlanWorkspaceSize = 402,
  kAttrOpPwDesc = 750, kAttrOpPwX = 751, kAttrOpPwB = 752, kAttrOpPwY = 753, kAttrOpPwT = 758,
  kAttrGraphHandle = 800, kAttrGraphOps = 801,
  kAttrTensorAlignment = 900, kAttrTensorDataType = 901, kAttrTensorDims = 902,
  kAttrTensorStrides = 903, kAttrTensorUid = 906, kAttrTensorVirtual = 907,
  kAttrTensorByValue = 908,
  kAttrPackUids = 1000, kAttrPackPointers = 1001, kAttrPackWorkspace = 1003,
  kAttrMatmulCompType = 1500, kAttrOpMatmulA = 1520, kAttrOpMatmulB = 1521,
  kAttrOpMatmulC = 1522, kAttrOpMatmulDesc = 1523,
  kAttrReductionOperator = 1600, kAttrReductionCompType = 1601,
  kAttrOpReductionX = 1610, kAttrOpReductionY = 1611, kAttrOpReductionDesc = 1612,
};

}  // namespace

#if __has_include(<cudnn_graph.h>)
}  // namespace sparsex
#include <cudnn_graph.h>
namespace sparsex {
constexpr bool Same(int a, int b) { return a == b; }
// The deprecated handle attributes (graph 800, plan 400) are left out: they carry a
// deprecation attribute in the header.
static_assert(Same(kPointwiseDesc, CUDNN_BACKEND_POINTWISE_DESCRIPTOR));
static_assert(Same(kEngineCfgDesc, CUDNN_BACKEND_ENGINECFG_DESCRIPTOR));
static_assert(Same(kEngineHeurDesc, CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR));
static_assert(Same(kExecutionPlanDesc, CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR));
static_assert(Same(kOpPointwiseDesc, CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR));
static_assert(Same(kOpGraphDesc, CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR));
static_assert(Same(kVariantPackDesc, CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR));
static_assert(Same(kTensorDesc, CUDNN_BACKEND_TENSOR_DESCRIPTOR));
static_assert(Same(kMatmulDesc, CUDNN_BACKEND_MATMUL_DESCRIPTOR));
static_assert(Same(kOpMatmulDesc, CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR));
static_assert(Same(kReductionDesc, CUDNN_BACKEND_REDUCTION_DESCRIPTOR));
static_assert(Same(kOpReductionDesc, CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR));
static_assert(Same(kTypeHandle, CUDNN_TYPE_HANDLE));
static_assert(Same(kTypeDataType, CUDNN_TYPE_DATA_TYPE));
static_assert(Same(kTypeBoolean, CUDNN_TYPE_BOOLEAN));
static_assert(Same(kTypeInt64, CUDNN_TYPE_INT64));
static_assert(Same(kTypeVoidPtr, CUDNN_TYPE_VOID_PTR));
static_assert(Same(kTypeHeurMode, CUDNN_TYPE_HEUR_MODE));
static_assert(Same(kTypePointwiseMode, CUDNN_TYPE_POINTWISE_MODE));
static_assert(Same(kTypeBackendDescriptor, CUDNN_TYPE_BACKEND_DESCRIPTOR));
static_assert(Same(kTypeReductionOperator, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE));
static_assert(Same(kFloat, CUDNN_DATA_FLOAT));
static_assert(Same(kInt32, CUDNN_DATA_INT32));
static_assert(Same(kBf16, CUDNN_DATA_BFLOAT16));
static_assert(Same(kBoolean, CUDNN_DATA_BOOLEAN));
static_assert(Same(kPwAdd, CUDNN_POINTWISE_ADD));
static_assert(Same(kPwMul, CUDNN_POINTWISE_MUL));
static_assert(Same(kPwDiv, CUDNN_POINTWISE_DIV));
static_assert(Same(kPwSub, CUDNN_POINTWISE_SUB));
static_assert(Same(kPwExp, CUDNN_POINTWISE_EXP));
static_assert(Same(kPwLog, CUDNN_POINTWISE_LOG));
static_assert(Same(kPwCmpGe, CUDNN_POINTWISE_CMP_GE));
static_assert(Same(kPwGenIndex, CUDNN_POINTWISE_GEN_INDEX));
static_assert(Same(kPwBinarySelect, CUDNN_POINTWISE_BINARY_SELECT));
static_assert(Same(kReduceAdd, CUDNN_REDUCE_TENSOR_ADD));
static_assert(Same(kReduceMax, CUDNN_REDUCE_TENSOR_MAX));
static_assert(Same(kHeurA, CUDNN_HEUR_MODE_A));
static_assert(Same(kHeurFallback, CUDNN_HEUR_MODE_FALLBACK));
static_assert(Same(kAttrPointwiseMode, CUDNN_ATTR_POINTWISE_MODE));
static_assert(Same(kAttrPointwiseMathPrec, CUDNN_ATTR_POINTWISE_MATH_PREC));
static_assert(Same(kAttrPointwiseAxis, CUDNN_ATTR_POINTWISE_AXIS));
static_assert(Same(kAttrHeurMode, CUDNN_ATTR_ENGINEHEUR_MODE));
static_assert(Same(kAttrHeurGraph, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH));
static_assert(Same(kAttrHeurResults, CUDNN_ATTR_ENGINEHEUR_RESULTS));
static_assert(Same(kAttrPlanEngineConfig, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG));
static_assert(Same(kAttrPlanWorkspaceSize, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE));
static_assert(Same(kAttrOpPwDesc, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR));
static_assert(Same(kAttrOpPwX, CUDNN_ATTR_OPERATION_POINTWISE_XDESC));
static_assert(Same(kAttrOpPwB, CUDNN_ATTR_OPERATION_POINTWISE_BDESC));
static_assert(Same(kAttrOpPwY, CUDNN_ATTR_OPERATION_POINTWISE_YDESC));
static_assert(Same(kAttrOpPwT, CUDNN_ATTR_OPERATION_POINTWISE_TDESC));
static_assert(Same(kAttrGraphOps, CUDNN_ATTR_OPERATIONGRAPH_OPS));
static_assert(Same(kAttrTensorAlignment, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT));
static_assert(Same(kAttrTensorDataType, CUDNN_ATTR_TENSOR_DATA_TYPE));
static_assert(Same(kAttrTensorDims, CUDNN_ATTR_TENSOR_DIMENSIONS));
static_assert(Same(kAttrTensorStrides, CUDNN_ATTR_TENSOR_STRIDES));
static_assert(Same(kAttrTensorUid, CUDNN_ATTR_TENSOR_UNIQUE_ID));
static_assert(Same(kAttrTensorVirtual, CUDNN_ATTR_TENSOR_IS_VIRTUAL));
static_assert(Same(kAttrTensorByValue, CUDNN_ATTR_TENSOR_IS_BY_VALUE));
static_assert(Same(kAttrPackUids, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS));
static_assert(Same(kAttrPackPointers, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS));
static_assert(Same(kAttrPackWorkspace, CUDNN_ATTR_VARIANT_PACK_WORKSPACE));
static_assert(Same(kAttrMatmulCompType, CUDNN_ATTR_MATMUL_COMP_TYPE));
static_assert(Same(kAttrOpMatmulA, CUDNN_ATTR_OPERATION_MATMUL_ADESC));
static_assert(Same(kAttrOpMatmulB, CUDNN_ATTR_OPERATION_MATMUL_BDESC));
static_assert(Same(kAttrOpMatmulC, CUDNN_ATTR_OPERATION_MATMUL_CDESC));
static_assert(Same(kAttrOpMatmulDesc, CUDNN_ATTR_OPERATION_MATMUL_DESC));
static_assert(Same(kAttrReductionOperator, CUDNN_ATTR_REDUCTION_OPERATOR));
static_assert(Same(kAttrReductionCompType, CUDNN_ATTR_REDUCTION_COMP_TYPE));
static_assert(Same(kAttrOpReductionX, CUDNN_ATTR_OPERATION_REDUCTION_XDESC));
static_assert(Same(kAttrOpReductionY, CUDNN_ATTR_OPERATION_REDUCTION_YDESC));
static_assert(Same(kAttrOpReductionDesc, CUDNN_ATTR_OPERATION_REDUCTION_DESC));
#endif

// The entry points, resolved from the library.
struct CudnnAttention::Api {
  void* lib = nullptr;
  Status (*create)(void**) = nullptr;
  Status (*destroy)(void*) = nullptr;
  Status (*set_stream)(void*, cudaStream_t) = nullptr;
  size_t (*get_version)() = nullptr;
  const char* (*error_string)(Status) = nullptr;
  void (*last_error)(char*, size_t) = nullptr;  // optional
  Status (*create_desc)(int, Desc*) = nullptr;
  Status (*destroy_desc)(Desc) = nullptr;
  Status (*set_attr)(Desc, int, int, int64_t, const void*) = nullptr;
  Status (*get_attr)(Desc, int, int, int64_t, int64_t*, void*) = nullptr;
  Status (*finalize)(Desc) = nullptr;
  Status (*execute)(void*, Desc, Desc) = nullptr;

  ~Api() {
    if (lib) dlclose(lib);
  }
  std::string Error(Status s) const {
    std::string msg = error_string ? error_string(s) : "cuDNN status " + std::to_string(s);
    if (last_error) {
      char buf[512] = {0};
      last_error(buf, sizeof(buf));
      if (buf[0]) msg += std::string(": ") + buf;
    }
    return msg;
  }
};

// Everything a built plan refers to; descriptors are destroyed with it.
struct CudnnAttention::Plan {
  const Api* api = nullptr;
  std::vector<Desc> keep;
  Desc plan = nullptr;
  int64_t workspace = 0;
  bool offset = false;     // the causal limit is shifted (n_q < n_kv)
  bool stats_out = false;  // the softmax statistics are a real output (kUidStats)
  absl::Status error;   // why no plan exists for this shape (then plan is null)
  ~Plan() {
    for (auto it = keep.rbegin(); it != keep.rend(); ++it) api->destroy_desc(*it);
  }
};

namespace {

// Builds descriptors; the first error sticks and later calls do nothing.
class Builder {
 public:
  template <typename A>
  explicit Builder(const A& api, std::vector<Desc>& keep)
      : create_(api.create_desc), set_(api.set_attr), fin_(api.finalize), keep_(keep) {}

  Desc Make(int type) {
    Desc d = nullptr;
    if (status_ == 0) status_ = create_(type, &d);
    if (d) keep_.push_back(d);
    return d;
  }
  void Set(Desc d, int attr, int type, int64_t count, const void* value) {
    if (status_ == 0) status_ = set_(d, attr, type, count, value);
  }
  void SetDesc(Desc d, int attr, Desc value) { Set(d, attr, kTypeBackendDescriptor, 1, &value); }
  void Finalize(Desc d) {
    if (status_ == 0) status_ = fin_(d);
  }
  // A 4-D tensor descriptor.
  Desc Tensor(int64_t uid, int dtype, std::array<int64_t, 4> dims, std::array<int64_t, 4> strides,
              bool is_virtual, bool by_value = false) {
    Desc t = Make(kTensorDesc);
    const int64_t align = 16;
    Set(t, kAttrTensorUid, kTypeInt64, 1, &uid);
    Set(t, kAttrTensorDataType, kTypeDataType, 1, &dtype);
    Set(t, kAttrTensorDims, kTypeInt64, 4, dims.data());
    Set(t, kAttrTensorStrides, kTypeInt64, 4, strides.data());
    Set(t, kAttrTensorAlignment, kTypeInt64, 1, &align);
    Set(t, kAttrTensorVirtual, kTypeBoolean, 1, &is_virtual);
    if (by_value) Set(t, kAttrTensorByValue, kTypeBoolean, 1, &by_value);
    Finalize(t);
    return t;
  }
  Desc Scalar(int64_t uid, int dtype) {
    return Tensor(uid, dtype, {1, 1, 1, 1}, {1, 1, 1, 1}, false, true);
  }
  // y = mode(x[, b[, t]]): one pointwise operation.
  Desc Pointwise(int mode, int prec, Desc x, Desc b, Desc t, Desc y, int64_t axis = -1) {
    Desc pw = Make(kPointwiseDesc);
    Set(pw, kAttrPointwiseMode, kTypePointwiseMode, 1, &mode);
    Set(pw, kAttrPointwiseMathPrec, kTypeDataType, 1, &prec);
    if (axis >= 0) Set(pw, kAttrPointwiseAxis, kTypeInt64, 1, &axis);
    Finalize(pw);
    Desc op = Make(kOpPointwiseDesc);
    SetDesc(op, kAttrOpPwDesc, pw);
    SetDesc(op, kAttrOpPwX, x);
    if (b) SetDesc(op, kAttrOpPwB, b);
    if (t) SetDesc(op, kAttrOpPwT, t);
    SetDesc(op, kAttrOpPwY, y);
    Finalize(op);
    return op;
  }
  Desc Reduction(int op_kind, Desc x, Desc y) {
    Desc r = Make(kReductionDesc);
    const int comp = kFloat;
    Set(r, kAttrReductionOperator, kTypeReductionOperator, 1, &op_kind);
    Set(r, kAttrReductionCompType, kTypeDataType, 1, &comp);
    Finalize(r);
    Desc op = Make(kOpReductionDesc);
    SetDesc(op, kAttrOpReductionX, x);
    SetDesc(op, kAttrOpReductionY, y);
    SetDesc(op, kAttrOpReductionDesc, r);
    Finalize(op);
    return op;
  }
  Desc Matmul(Desc a, Desc b, Desc c) {
    Desc m = Make(kMatmulDesc);
    const int comp = kFloat;
    Set(m, kAttrMatmulCompType, kTypeDataType, 1, &comp);
    Finalize(m);
    Desc op = Make(kOpMatmulDesc);
    SetDesc(op, kAttrOpMatmulA, a);
    SetDesc(op, kAttrOpMatmulB, b);
    SetDesc(op, kAttrOpMatmulC, c);
    SetDesc(op, kAttrOpMatmulDesc, m);
    Finalize(op);
    return op;
  }
  Status status() const { return status_; }
  void set_status(Status s) { status_ = s; }

 private:
  Status (*create_)(int, Desc*);
  Status (*set_)(Desc, int, int, int64_t, const void*);
  Status (*fin_)(Desc);
  std::vector<Desc>& keep_;
  Status status_ = 0;
};

// Tensor ids of the variant pack (the rest are virtual).
enum : int64_t {
  kUidQ = 1, kUidK, kUidV, kUidO, kUidScale, kUidNegInf, kUidOffset, kUidStats, kUidVirtual = 100
};

template <typename T>
bool Resolve(void* lib, const char* name, T& fn) {
  fn = reinterpret_cast<T>(dlsym(lib, name));
  return fn != nullptr;
}

}  // namespace

absl::StatusOr<std::unique_ptr<CudnnAttention>> CudnnAttention::Create(
    cudaStream_t stream, const std::string& library) {
  auto api = std::make_unique<Api>();
  for (const char* name : {library.c_str(), "libcudnn.so.9", "libcudnn.so"}) {
    if (name == nullptr || *name == 0) continue;
    api->lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
    if (api->lib) break;
  }
  if (!api->lib) {
    const char* why = dlerror();
    return absl::UnavailableError(absl::StrCat("cuDNN not loadable: ", why ? why : "?"));
  }
  void* lib = api->lib;
  bool ok = Resolve(lib, "cudnnCreate", api->create) &&
            Resolve(lib, "cudnnDestroy", api->destroy) &&
            Resolve(lib, "cudnnSetStream", api->set_stream) &&
            Resolve(lib, "cudnnGetVersion", api->get_version) &&
            Resolve(lib, "cudnnGetErrorString", api->error_string) &&
            Resolve(lib, "cudnnBackendCreateDescriptor", api->create_desc) &&
            Resolve(lib, "cudnnBackendDestroyDescriptor", api->destroy_desc) &&
            Resolve(lib, "cudnnBackendSetAttribute", api->set_attr) &&
            Resolve(lib, "cudnnBackendGetAttribute", api->get_attr) &&
            Resolve(lib, "cudnnBackendFinalize", api->finalize) &&
            Resolve(lib, "cudnnBackendExecute", api->execute);
  if (!ok) return absl::UnavailableError("cuDNN: backend API entry points missing");
  Resolve(lib, "cudnnGetLastErrorString", api->last_error);
  // The graph API with these operations is cuDNN 9's.
  if (api->get_version() < 90000) {
    return absl::UnavailableError(absl::StrCat("cuDNN ", api->get_version(), " is older than 9"));
  }
  std::unique_ptr<CudnnAttention> dnn(new CudnnAttention());
  if (Status s = api->create(&dnn->handle_); s != 0) {
    return absl::UnavailableError(absl::StrCat("cudnnCreate: ", api->Error(s)));
  }
  if (Status s = api->set_stream(dnn->handle_, stream); s != 0) {
    api->destroy(dnn->handle_);
    dnn->handle_ = nullptr;
    return absl::UnavailableError(absl::StrCat("cudnnSetStream: ", api->Error(s)));
  }
  dnn->stream_ = stream;
  dnn->api_ = std::move(api);
  return dnn;
}

CudnnAttention::~CudnnAttention() {
  plans_.clear();
  if (handle_ && api_) api_->destroy(handle_);
}

std::string CudnnAttention::version() const {
  const size_t v = api_->get_version();  // major * 10000 + minor * 100 + patch
  return absl::StrCat(v / 10000, ".", v / 100 % 100, ".", v % 100);
}

// The graph cuDNN's fused flash-attention engine recognises (the one cudnn-frontend emits for
// causal SDPA before cuDNN 9.21): S = Q K^T; S *= scale; S = row + offset >= col ? S : -max;
// P = softmax(S) as max, sub, exp, sum, div; O = P V. Intermediates are virtual fp32, P bf16.
absl::StatusOr<std::unique_ptr<CudnnAttention::Plan>> CudnnAttention::Build(
    const CudnnAttentionShape& s, bool stats_out) {
  auto plan = std::make_unique<Plan>();
  plan->api = api_.get();
  Builder b(*api_, plan->keep);
  const int64_t H = s.heads, KV = s.kv_heads, d = s.head_dim, nq = s.n_q, nk = s.n_kv;
  // Q [1, H, nq, d], K^T [1, KV, d, nk], V [1, KV, nk, d], O [1, H, nq, d] over row-major
  // matrices whose rows hold the heads side by side.
  Desc q = b.Tensor(kUidQ, kBf16, {1, H, nq, d}, {nq * s.q_stride, d, s.q_stride, 1}, false);
  Desc kt = b.Tensor(kUidK, kBf16, {1, KV, d, nk}, {nk * s.kv_stride, d, 1, s.kv_stride}, false);
  Desc v = b.Tensor(kUidV, kBf16, {1, KV, nk, d}, {nk * s.kv_stride, d, s.kv_stride, 1}, false);
  Desc o = b.Tensor(kUidO, kBf16, {1, H, nq, d}, {nq * s.o_stride, d, s.o_stride, 1}, false);
  Desc scale = b.Scalar(kUidScale, kFloat);
  Desc neg_inf = b.Scalar(kUidNegInf, kFloat);
  plan->offset = nq != nk;
  Desc offset = plan->offset ? b.Scalar(kUidOffset, kInt32) : nullptr;

  int64_t uid = kUidVirtual;
  const std::array<int64_t, 4> sdims = {1, H, nq, nk}, sstr = {H * nq * nk, nq * nk, nk, 1};
  const std::array<int64_t, 4> rdims = {1, H, nq, 1}, rstr = {H * nq, nq, 1, 1};
  auto scores = [&](int dtype) { return b.Tensor(uid++, dtype, sdims, sstr, true); };
  auto rows = [&]() { return b.Tensor(uid++, kFloat, rdims, rstr, true); };

  std::vector<Desc> ops;
  Desc s0 = scores(kFloat);
  ops.push_back(b.Matmul(q, kt, s0));
  Desc s1 = scores(kFloat);
  ops.push_back(b.Pointwise(kPwMul, kFloat, s0, scale, nullptr, s1));
  Desc row = scores(kInt32);
  ops.push_back(b.Pointwise(kPwGenIndex, kFloat, s1, nullptr, nullptr, row, 2));
  Desc col = scores(kInt32);
  ops.push_back(b.Pointwise(kPwGenIndex, kFloat, s1, nullptr, nullptr, col, 3));
  if (offset) {
    Desc shifted = scores(kInt32);
    ops.push_back(b.Pointwise(kPwAdd, kInt32, row, offset, nullptr, shifted));
    row = shifted;
  }
  Desc keep = scores(kBoolean);
  ops.push_back(b.Pointwise(kPwCmpGe, kBoolean, row, col, nullptr, keep));
  Desc s2 = scores(kFloat);
  ops.push_back(b.Pointwise(kPwBinarySelect, kFloat, s1, neg_inf, keep, s2));
  Desc mx = rows();
  ops.push_back(b.Reduction(kReduceMax, s2, mx));
  Desc s3 = scores(kFloat);
  ops.push_back(b.Pointwise(kPwSub, kFloat, s2, mx, nullptr, s3));
  Desc e = scores(kFloat);
  ops.push_back(b.Pointwise(kPwExp, kFloat, s3, nullptr, nullptr, e));
  Desc sum = rows();
  ops.push_back(b.Reduction(kReduceAdd, e, sum));
  // The statistics max + log(sum): the engine's pattern includes them even for inference (a
  // virtual output then); some versions only take them as a real output.
  Desc log_sum = rows();
  ops.push_back(b.Pointwise(kPwLog, kFloat, sum, nullptr, nullptr, log_sum));
  plan->stats_out = stats_out;
  Desc stats = stats_out ? b.Tensor(kUidStats, kFloat, rdims, rstr, false) : rows();
  ops.push_back(b.Pointwise(kPwAdd, kFloat, mx, log_sum, nullptr, stats));
  Desc p = scores(kBf16);  // the second matmul takes P in the I/O type
  ops.push_back(b.Pointwise(kPwDiv, kFloat, e, sum, nullptr, p));
  ops.push_back(b.Matmul(p, v, o));

  Desc graph = b.Make(kOpGraphDesc);
  b.Set(graph, kAttrGraphHandle, kTypeHandle, 1, &handle_);
  b.Set(graph, kAttrGraphOps, kTypeBackendDescriptor, static_cast<int64_t>(ops.size()),
        ops.data());
  b.Finalize(graph);
  if (b.status() != 0) {
    return absl::UnimplementedError(
        absl::StrCat("cuDNN attention graph: ", api_->Error(b.status())));
  }

  // Heuristics (mode A, then fallback) give engine configurations; the first whose plan
  // finalizes is taken.
  std::string why;
  for (int mode : {static_cast<int>(kHeurA), static_cast<int>(kHeurFallback)}) {
    const char* mode_name = mode == kHeurA ? "heuristics A" : "fallback";
    Desc heur = b.Make(kEngineHeurDesc);
    b.SetDesc(heur, kAttrHeurGraph, graph);
    b.Set(heur, kAttrHeurMode, kTypeHeurMode, 1, &mode);
    b.Finalize(heur);
    int64_t count = 0;
    if (b.status() == 0) {
      b.set_status(api_->get_attr(heur, kAttrHeurResults, kTypeBackendDescriptor, 0, &count,
                                  nullptr));
    }
    if (b.status() != 0) {
      absl::StrAppend(&why, mode_name, ": ", api_->Error(b.status()), "; ");
      b.set_status(0);
      continue;
    }
    std::vector<Desc> cfgs;
    for (int64_t i = 0; i < count; ++i) cfgs.push_back(b.Make(kEngineCfgDesc));
    int64_t got = 0;
    if (b.status() == 0 && count > 0) {
      b.set_status(api_->get_attr(heur, kAttrHeurResults, kTypeBackendDescriptor, count, &got,
                                  cfgs.data()));
    }
    absl::StrAppend(&why, mode_name, ": ", got, " configurations");
    for (int64_t i = 0; i < got && b.status() == 0; ++i) {
      Desc cand = nullptr;
      if (api_->create_desc(kExecutionPlanDesc, &cand) != 0) break;
      // The plan's handle attribute is deprecated in cuDNN 9 (the graph's is used): best effort.
      (void)api_->set_attr(cand, kAttrPlanHandle, kTypeHandle, 1, &handle_);
      Status st = api_->set_attr(cand, kAttrPlanEngineConfig, kTypeBackendDescriptor, 1, &cfgs[i]);
      if (st == 0) st = api_->finalize(cand);
      if (st == 0) {
        plan->keep.push_back(cand);
        plan->plan = cand;
        break;
      }
      if (i == 0) absl::StrAppend(&why, " (first: ", api_->Error(st), ")");
      api_->destroy_desc(cand);
    }
    if (plan->plan) break;
    if (b.status() != 0) absl::StrAppend(&why, " ", api_->Error(b.status()));
    absl::StrAppend(&why, "; ");
    b.set_status(0);
  }
  if (!plan->plan) {
    return absl::UnimplementedError(absl::StrCat("cuDNN attention: no plan for ", nq, "x", nk,
                                                 " H", H, "/", KV, " d", d, ": ", why));
  }
  if (Status st = api_->get_attr(plan->plan, kAttrPlanWorkspaceSize, kTypeInt64, 1, nullptr,
                                 &plan->workspace);
      st != 0) {
    return absl::InternalError(absl::StrCat("cuDNN workspace size: ", api_->Error(st)));
  }
  return plan;
}

absl::StatusOr<CudnnAttention::Plan*> CudnnAttention::GetPlan(const CudnnAttentionShape& s) {
  auto it = plans_.find(s.Key());
  if (it == plans_.end()) {
    // Plans are small but each distinct prompt length makes one: bound the cache.
    if (plans_.size() >= 64) plans_.clear();
    const auto t0 = std::chrono::steady_clock::now();
    auto built = Build(s, /*stats_out=*/s.stats_out);
    if (!built.ok() && !s.stats_out) {
      auto again = Build(s, /*stats_out=*/true);
      if (again.ok()) {
        built = std::move(again);
      } else {
        built = absl::UnimplementedError(absl::StrCat(built.status().message(),
                                                      " | with statistics output: ",
                                                      again.status().message()));
      }
    }
    plan_build_ms_ += std::chrono::duration<double, std::milli>(
                          std::chrono::steady_clock::now() - t0).count();
    std::unique_ptr<Plan> p;
    if (built.ok()) {
      p = std::move(*built);
      ++plans_built_;
    } else {
      p = std::make_unique<Plan>();
      p->api = api_.get();
      p->error = built.status();
    }
    it = plans_.emplace(s.Key(), std::move(p)).first;
  }
  Plan* p = it->second.get();
  if (!p->plan) return p->error;
  return p;
}

absl::Status CudnnAttention::Run(const CudnnAttentionShape& s, const void* q, const void* k,
                                 const void* v, void* o, float* lse) {
  if (s.n_q <= 0 || s.n_kv < s.n_q || s.heads <= 0 || s.kv_heads <= 0 ||
      s.heads % s.kv_heads != 0 || s.head_dim <= 0) {
    return absl::InvalidArgumentError("cuDNN attention: bad shape");
  }
  if (s.stats_out != (lse != nullptr)) {
    return absl::InvalidArgumentError("cuDNN attention: stats_out and lse go together");
  }
  ASSIGN_OR_RETURN(Plan * p, GetPlan(s));
  ASSIGN_OR_RETURN(void* ws, workspace_.Get(static_cast<size_t>(p->workspace), stream_));
  float scale = s.scale;
  float neg_inf = std::numeric_limits<float>::lowest();
  int32_t offset = static_cast<int32_t>(s.n_kv - s.n_q);
  std::vector<int64_t> uids = {kUidQ, kUidK, kUidV, kUidO, kUidScale, kUidNegInf};
  std::vector<void*> ptrs = {const_cast<void*>(q), const_cast<void*>(k), const_cast<void*>(v), o,
                             &scale, &neg_inf};
  if (p->offset) {
    uids.push_back(kUidOffset);
    ptrs.push_back(&offset);
  }
  if (p->stats_out) {
    void* stats = lse;
    if (stats == nullptr) {
      ASSIGN_OR_RETURN(stats,
                       stats_.Get(static_cast<size_t>(s.heads) * s.n_q * sizeof(float), stream_));
    }
    uids.push_back(kUidStats);
    ptrs.push_back(stats);
  }
  Desc pack = nullptr;
  Status st = api_->create_desc(kVariantPackDesc, &pack);
  if (st == 0) {
    st = api_->set_attr(pack, kAttrPackUids, kTypeInt64, static_cast<int64_t>(uids.size()),
                        uids.data());
  }
  if (st == 0) {
    st = api_->set_attr(pack, kAttrPackPointers, kTypeVoidPtr, static_cast<int64_t>(ptrs.size()),
                        ptrs.data());
  }
  if (st == 0) st = api_->set_attr(pack, kAttrPackWorkspace, kTypeVoidPtr, 1, &ws);
  if (st == 0) st = api_->finalize(pack);
  if (st == 0) st = api_->execute(handle_, p->plan, pack);
  if (pack) api_->destroy_desc(pack);
  if (st != 0) return absl::InternalError(absl::StrCat("cuDNN attention: ", api_->Error(st)));
  return absl::OkStatus();
}

}  // namespace sparsex
