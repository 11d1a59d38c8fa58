// KV block wire format (common/kv_block.h): what a cache server and a worker read from each
// other and from disk. The input is decoded as is (almost always refused at the header
// checksum), then again with both checksums recomputed, so the fuzzer reaches the shape and size
// checks behind them. A block that decodes must re-encode to the same bytes.
#include <cstring>
#include <string>

#include "common/hash.h"
#include "common/kv_block.h"
#include "tests/fuzz/fuzz_util.h"

using namespace sparsex;

namespace {

void Check(std::span<const uint8_t> bytes) {
  absl::StatusOr<KvBlockHeader> h = DecodeKvBlockHeader(bytes);
  if (!h.ok()) {
    if (h.status().code() != absl::StatusCode::kDataLoss) std::abort();
    return;
  }
  (void)KvDtypeName(h->dtype);
  (void)CheckKvLayout(*h);
  (void)KvBlockEncodedBytes(*h);
  absl::StatusOr<KvBlockView> v = DecodeKvBlock(bytes);
  if (!v.ok()) {
    if (v.status().code() != absl::StatusCode::kDataLoss) std::abort();
    return;
  }
  (void)KvBlockWireChecksum(bytes);
  absl::StatusOr<KvBlockView> verified = VerifyKvBlock(bytes);
  fuzz::Report("VerifyKvBlock", verified.status());
  if (!verified.ok()) return;
  // Round trip: the header's fields and the payload give back the same block (reserved bytes
  // are written as 0, so compare only when the input had them 0).
  absl::StatusOr<std::string> again = EncodeKvBlock(v->header, v->payload);
  if (!again.ok()) std::abort();
  if (again->size() != bytes.size()) std::abort();
  absl::StatusOr<KvBlockView> back = VerifyKvBlock(KvBlockBytes(*again));
  if (!back.ok() || !(back->header == v->header)) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Check({data, size});
  if (size >= kKvBlockHeaderBytes) {
    std::string fixed(reinterpret_cast<const char*>(data), size);
    auto* p = reinterpret_cast<uint8_t*>(fixed.data());
    const uint64_t payload = Hash64(p + kKvBlockHeaderBytes, size - kKvBlockHeaderBytes);
    std::memcpy(p + 72, &payload, 8);
    const uint64_t header = Hash64(p, 120);
    std::memcpy(p + 120, &header, 8);
    Check(KvBlockBytes(fixed));
  }
  return 0;
}
