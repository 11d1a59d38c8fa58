// Built only with SPARSEX_WITH_CUDA and SPARSEX_WITH_NCCL (gpu_worker/CMakeLists.txt).
#include "gpu_worker/engine/nccl_communicator.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdlib>
#include <iostream>
#include <string>

#include "gpu_worker/backend/cuda/cuda_backend.h"

namespace sparsex {
namespace {

#define SPX_NCCL_RETURN(expr, what)                                                       \
  do {                                                                                    \
    ncclResult_t spx_r_ = (expr);                                                         \
    if (spx_r_ != ncclSuccess) {                                                          \
      return absl::InternalError(absl::StrCat("NCCL ", what, ": ",                        \
                                              ncclGetErrorString(spx_r_)));               \
    }                                                                                     \
  } while (0)

#define SPX_CUDA_RETURN(expr, what)                                                       \
  do {                                                                                    \
    cudaError_t spx_e_ = (expr);                                                          \
    if (spx_e_ != cudaSuccess) {                                                          \
      return absl::InternalError(absl::StrCat("CUDA ", what, ": ",                        \
                                              cudaGetErrorString(spx_e_)));               \
    }                                                                                     \
  } while (0)

// ncclCommInitAll and teardown may run on any thread: keep that thread's current device.
struct DeviceGuard {
  int prev = -1;
  DeviceGuard() {
    if (cudaGetDevice(&prev) != cudaSuccess) prev = -1;
  }
  ~DeviceGuard() {
    if (prev >= 0) cudaSetDevice(prev);
  }
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, int rank, int size, int device)
      : comm_(comm), rank_(rank), size_(size), device_(device) {}
  ~NcclCommunicator() override {
    DeviceGuard g;
    cudaSetDevice(device_);
    if (stream_) cudaStreamSynchronize(stream_);
    if (buf_) cudaFree(buf_);
    if (stream_) cudaStreamDestroy(stream_);
    ncclCommDestroy(comm_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  absl::Status AllReduceSum(Backend& be, Tensor& t) override {
    cudaStream_t s = CudaBackendStream(be);
    if (s == nullptr || t.host) {
      return absl::FailedPreconditionError("NCCL all-reduce needs a tensor of a CUDA backend");
    }
    ncclDataType_t dt = ncclFloat32;
    switch (t.dtype) {
      case DType::kF32: dt = ncclFloat32; break;
      case DType::kF16: dt = ncclFloat16; break;
      case DType::kBF16: dt = ncclBfloat16; break;
    }
    // Same shape on every rank, so an empty tensor is skipped by all of them alike.
    if (t.empty()) return absl::OkStatus();
    SPX_NCCL_RETURN(ncclAllReduce(t.data, t.data, static_cast<size_t>(t.rows * t.cols), dt,
                                  ncclSum, comm_, s),
                    "all-reduce");
    return absl::OkStatus();
  }

  absl::Status AllReduceSumHost(std::span<float> v) override {
    if (v.empty()) return absl::OkStatus();
    // The caller is this rank's thread, whose current device is already device_ (the backend
    // set it); setting it again is cheap and makes the stream/buffer land on the right GPU.
    SPX_CUDA_RETURN(cudaSetDevice(device_), "set device");
    if (stream_ == nullptr) {
      SPX_CUDA_RETURN(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "stream");
    }
    if (v.size_bytes() > buf_bytes_) {
      if (buf_) SPX_CUDA_RETURN(cudaFree(buf_), "free");
      buf_ = nullptr;
      buf_bytes_ = 0;
      SPX_CUDA_RETURN(cudaMalloc(&buf_, v.size_bytes()), "staging buffer");
      buf_bytes_ = v.size_bytes();
    }
    SPX_CUDA_RETURN(cudaMemcpyAsync(buf_, v.data(), v.size_bytes(), cudaMemcpyHostToDevice,
                                    stream_),
                    "upload");
    SPX_NCCL_RETURN(ncclAllReduce(buf_, buf_, v.size(), ncclFloat32, ncclSum, comm_, stream_),
                    "host all-reduce");
    SPX_CUDA_RETURN(cudaMemcpyAsync(v.data(), buf_, v.size_bytes(), cudaMemcpyDeviceToHost,
                                    stream_),
                    "download");
    SPX_CUDA_RETURN(cudaStreamSynchronize(stream_), "host all-reduce sync");
    return absl::OkStatus();
  }

 private:
  ncclComm_t comm_;
  int rank_, size_, device_;
  cudaStream_t stream_ = nullptr;  // staging of host all-reduces
  void* buf_ = nullptr;
  size_t buf_bytes_ = 0;
};

}  // namespace

absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> CreateNcclGroup(
    std::span<const int> devices) {
  const int n = static_cast<int>(devices.size());
  if (n < 1) return absl::InvalidArgumentError("NCCL group: no devices");
  int count = 0;
  SPX_CUDA_RETURN(cudaGetDeviceCount(&count), "device count");
  for (int d : devices) {
    if (d < 0 || d >= count) {
      return absl::InvalidArgumentError(absl::StrCat("NCCL group: CUDA device ", d,
                                                     " does not exist (", count, " present)"));
    }
  }
  // NVLink multicast (NVLS) stays off: on shared hosts a program using it can take the GPUs out
  // of service, and these all-reduces do not need it. An explicit user setting wins
  // (overwrite = 0), with a warning when it turns NVLS on.
  setenv("NCCL_NVLS_ENABLE", "0", 0);
  if (const char* v = std::getenv("NCCL_NVLS_ENABLE"); v != nullptr && std::string(v) != "0") {
    std::cerr << "warning: NCCL_NVLS_ENABLE=" << v << " set by the environment: NVLink multicast "
              << "may be used" << std::endl;
  }
  std::vector<ncclComm_t> comms(n);
  {
    DeviceGuard g;
    SPX_NCCL_RETURN(ncclCommInitAll(comms.data(), n, devices.data()), "init");
  }
  std::vector<std::unique_ptr<Communicator>> out;
  for (int r = 0; r < n; ++r) {
    out.push_back(std::make_unique<NcclCommunicator>(comms[r], r, n, devices[r]));
  }
  return out;
}

}  // namespace sparsex
