// GGUF (v2/v3) loader. The file is memory-mapped; every read goes through a cursor that checks
// the remaining length first, so a cut or corrupt file yields an error, never an out-of-bounds
// read. Metadata values are kept as views into the mapping; arrays are recorded as (type, count,
// offset) and decoded only when a key is actually used (a 128K-token vocabulary is walked once
// for validation, then once more to build the tokenizer).
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/string_view.h"
#include "model/model.h"
#include "model/quant.h"

namespace sparsex {
namespace {

// GGUF metadata value types.
enum GgufType : uint32_t {
  kU8 = 0,
  kI8 = 1,
  kU16 = 2,
  kI16 = 3,
  kU32 = 4,
  kI32 = 5,
  kF32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kU64 = 10,
  kI64 = 11,
  kF64 = 12,
};

size_t ScalarSize(uint32_t t) {
  switch (t) {
    case kU8:
    case kI8:
    case kBool:
      return 1;
    case kU16:
    case kI16:
      return 2;
    case kU32:
    case kI32:
    case kF32:
      return 4;
    case kU64:
    case kI64:
    case kF64:
      return 8;
    default:
      return 0;  // string, array, unknown
  }
}

// ggml tensor type ids, for error messages naming unsupported (quantized) types.
const char* GgmlTypeName(uint32_t t) {
  static const char* const kNames[] = {
      "F32",   "F16",        "Q4_0",       "Q4_1",       "Q4_2",     "Q4_3",     "Q5_0",
      "Q5_1",  "Q8_0",       "Q8_1",       "Q2_K",       "Q3_K",     "Q4_K",     "Q5_K",
      "Q6_K",  "Q8_K",       "IQ2_XXS",    "IQ2_XS",     "IQ3_XXS",  "IQ1_S",    "IQ4_NL",
      "IQ3_S", "IQ2_S",      "IQ4_XS",     "I8",         "I16",      "I32",      "I64",
      "F64",   "IQ1_M",      "BF16",       "Q4_0_4_4",   "Q4_0_4_8", "Q4_0_8_8", "TQ1_0",
      "TQ2_0", "IQ4_NL_4_4", "IQ4_NL_4_8", "IQ4_NL_8_8", "MXFP4"};
  return t < std::size(kNames) ? kNames[t] : "unknown";
}

// The bytes a reader parses: the whole mapped file (LoadGguf), or only a prefix of it read into
// memory (LoadModelInfo: metadata and tensor infos, no weights), with the file's real size.
struct GgufBytes {
  const uint8_t* data = nullptr;
  size_t size = 0;       // bytes available at data
  size_t file_size = 0;  // bytes in the file
  std::string path;
};

// A read past the available prefix of a longer file is OUT_OF_RANGE (read more and parse again);
// a read past the end of the file is a truncated file.
absl::Status Truncated(const GgufBytes& f, size_t at, size_t need, const char* what) {
  if (f.size < f.file_size && at + need <= f.file_size) {
    return absl::OutOfRangeError(absl::StrCat("GGUF header of ", f.path, " extends past ", f.size,
                                              " bytes"));
  }
  return absl::DataLossError(absl::StrCat("GGUF file ", f.path, " is truncated: reading ", what,
                                          " needs ", need, " bytes at offset ", at));
}

class Cursor {
 public:
  explicit Cursor(const GgufBytes& f) : f_(f) {}
  size_t pos() const { return pos_; }
  void set_pos(size_t p) { pos_ = p; }
  size_t remaining() const { return f_.size - pos_; }
  size_t file_remaining() const { return f_.file_size - pos_; }

  absl::Status Need(size_t n, const char* what) const {
    if (n > remaining()) return Truncated(f_, pos_, n, what);
    return absl::OkStatus();
  }
  absl::Status TooShort(uint64_t n, const char* what) const { return Truncated(f_, pos_, n, what); }
  template <typename T>
  absl::StatusOr<T> Read(const char* what) {
    RETURN_IF_ERROR(Need(sizeof(T), what));
    T v;  // GGUF is little-endian, as is every host we run on
    std::memcpy(&v, f_.data + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  absl::StatusOr<absl::string_view> ReadString(const char* what) {
    ASSIGN_OR_RETURN(uint64_t n, Read<uint64_t>(what));
    RETURN_IF_ERROR(Need(n, what));
    absl::string_view s(reinterpret_cast<const char*>(f_.data) + pos_, n);
    pos_ += n;
    return s;
  }

 private:
  const GgufBytes& f_;
  size_t pos_ = 0;
};

struct KvValue {
  uint32_t type = 0;
  uint64_t u = 0;  // integer and bool scalars (sign-extended for signed types)
  double f = 0;    // float scalars
  absl::string_view str;
  uint32_t elem_type = 0;  // arrays: element type, count, offset of the first element
  uint64_t count = 0;
  size_t offset = 0;
};

// Reads (or, for arrays, walks and records) one value of type t.
absl::Status ReadValue(Cursor& c, uint32_t t, KvValue& v, int depth) {
  v.type = t;
  switch (t) {
    case kU8: {
      ASSIGN_OR_RETURN(uint8_t x, c.Read<uint8_t>("u8"));
      v.u = x;
      break;
    }
    case kI8: {
      ASSIGN_OR_RETURN(int8_t x, c.Read<int8_t>("i8"));
      v.u = static_cast<uint64_t>(int64_t{x});
      break;
    }
    case kU16: {
      ASSIGN_OR_RETURN(uint16_t x, c.Read<uint16_t>("u16"));
      v.u = x;
      break;
    }
    case kI16: {
      ASSIGN_OR_RETURN(int16_t x, c.Read<int16_t>("i16"));
      v.u = static_cast<uint64_t>(int64_t{x});
      break;
    }
    case kU32: {
      ASSIGN_OR_RETURN(uint32_t x, c.Read<uint32_t>("u32"));
      v.u = x;
      break;
    }
    case kI32: {
      ASSIGN_OR_RETURN(int32_t x, c.Read<int32_t>("i32"));
      v.u = static_cast<uint64_t>(int64_t{x});
      break;
    }
    case kU64: {
      ASSIGN_OR_RETURN(v.u, c.Read<uint64_t>("u64"));
      break;
    }
    case kI64: {
      ASSIGN_OR_RETURN(int64_t x, c.Read<int64_t>("i64"));
      v.u = static_cast<uint64_t>(x);
      break;
    }
    case kF32: {
      ASSIGN_OR_RETURN(float x, c.Read<float>("f32"));
      v.f = x;
      break;
    }
    case kF64: {
      ASSIGN_OR_RETURN(v.f, c.Read<double>("f64"));
      break;
    }
    case kBool: {
      ASSIGN_OR_RETURN(uint8_t x, c.Read<uint8_t>("bool"));
      v.u = x != 0;
      break;
    }
    case kString: {
      ASSIGN_OR_RETURN(v.str, c.ReadString("string value"));
      break;
    }
    case kArray: {
      if (depth > 8) return absl::InvalidArgumentError("GGUF metadata arrays nested too deeply");
      ASSIGN_OR_RETURN(v.elem_type, c.Read<uint32_t>("array type"));
      ASSIGN_OR_RETURN(v.count, c.Read<uint64_t>("array length"));
      v.offset = c.pos();
      if (size_t es = ScalarSize(v.elem_type); es != 0) {
        if (v.count > c.remaining() / es) {
          return c.TooShort(v.count * es, "array elements");
        }
        c.set_pos(c.pos() + v.count * es);
      } else if (v.elem_type == kString || v.elem_type == kArray) {
        KvValue elem;
        for (uint64_t i = 0; i < v.count; ++i) {
          RETURN_IF_ERROR(ReadValue(c, v.elem_type, elem, depth + 1));
        }
      } else {
        return absl::InvalidArgumentError(
            absl::StrCat("unknown GGUF array element type ", v.elem_type));
      }
      break;
    }
    default:
      return absl::InvalidArgumentError(absl::StrCat("unknown GGUF metadata type ", t));
  }
  return absl::OkStatus();
}

struct TensorInfo {
  std::vector<int64_t> shape;  // PyTorch order (outermost first)
  uint32_t type = 0;
  uint64_t offset = 0;  // relative to the data section
};

// Bytes per block and values per block of a tensor type this loader reads: 1 value of 4 or 2
// bytes for F32/F16/BF16, a block for the quantized types; false for any other type.
bool TypeBlock(uint32_t ggml_type, GgmlBlockLayout* l) {
  switch (ggml_type) {
    case kGgmlF32: *l = {1, 4}; return true;
    case kGgmlF16:
    case kGgmlBF16: *l = {1, 2}; return true;
    default: return GgmlQuantLayout(ggml_type, l);
  }
}

// F32/F16/BF16 from a ggml type id; false for anything else (quantized, integer).
bool ToDType(uint32_t ggml_type, DType* dt) {
  switch (ggml_type) {
    case 0:
      *dt = DType::kF32;
      return true;
    case 1:
      *dt = DType::kF16;
      return true;
    case 30:
      *dt = DType::kBF16;
      return true;
    default:
      return false;
  }
}

class GgufReader {
 public:
  explicit GgufReader(GgufBytes f) : f_(std::move(f)) {}

  absl::Status Parse();

  const KvValue* Find(absl::string_view key) const {
    auto it = kv_.find(key);
    return it == kv_.end() ? nullptr : &it->second;
  }
  absl::StatusOr<uint64_t> GetUInt(absl::string_view key) const;
  absl::StatusOr<double> GetFloat(absl::string_view key) const;
  absl::StatusOr<absl::string_view> GetString(absl::string_view key) const;
  absl::StatusOr<bool> GetBool(absl::string_view key) const;
  absl::StatusOr<std::vector<std::string>> GetStringArray(absl::string_view key) const;
  absl::StatusOr<std::vector<float>> GetFloatArray(absl::string_view key) const;
  absl::StatusOr<std::vector<int32_t>> GetIntArray(absl::string_view key) const;
  // Fills *t from the tensor called name; InvalidArgument ("missing tensor") when absent. A
  // quantized tensor (Q8_0, Q4_0, Q4_K, Q6_K) is dequantized into a new buffer appended to
  // *owned, as dequant_to; without owned it is Unimplemented.
  absl::Status GetTensor(const std::string& name, TensorView* t,
                         std::vector<std::vector<uint8_t>>* owned = nullptr,
                         DType dequant_to = DType::kF32) const;
  // Tensor names in file order, and their infos.
  const std::vector<std::string>& tensor_order() const { return order_; }
  const TensorInfo& info(const std::string& name) const { return tensors_.at(name); }
  size_t data_start() const { return data_start_; }
  size_t kv_begin() const { return kv_begin_; }
  size_t kv_end() const { return kv_end_; }
  bool HasTensor(const std::string& name) const { return tensors_.contains(name); }
  // Shape of a tensor without touching its data (empty when absent).
  std::vector<int64_t> TensorShape(const std::string& name) const {
    auto it = tensors_.find(name);
    return it == tensors_.end() ? std::vector<int64_t>{} : it->second.shape;
  }
  const std::string& path() const { return f_.path; }
  size_t num_tensors() const { return tensors_.size(); }

 private:
  absl::StatusOr<uint64_t> Extent(const std::string& name, const TensorInfo& ti,
                                  const GgmlBlockLayout& l) const;
  absl::StatusOr<const KvValue*> Get(absl::string_view key) const;
  absl::StatusOr<const KvValue*> GetArray(absl::string_view key) const;

  GgufBytes f_;
  absl::flat_hash_map<absl::string_view, KvValue> kv_;
  absl::flat_hash_map<std::string, TensorInfo> tensors_;
  std::vector<std::string> order_;
  size_t data_start_ = 0;
  size_t kv_begin_ = 0, kv_end_ = 0;  // the metadata section's bytes
};

absl::Status GgufReader::Parse() {
  Cursor c(f_);
  const std::string& path = f_.path;
  RETURN_IF_ERROR(c.Need(4, "magic"));
  if (std::memcmp(f_.data, "GGUF", 4) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(path, " is not a GGUF file (bad magic)"));
  }
  c.set_pos(4);
  ASSIGN_OR_RETURN(uint32_t version, c.Read<uint32_t>("version"));
  if (version == 1) {
    return absl::UnimplementedError(absl::StrCat(path, ": GGUF version 1 is not supported"));
  }
  if (version != 2 && version != 3) {  // a big-endian file reads as 0x02000000 / 0x03000000
    return absl::UnimplementedError(
        absl::StrCat(path, ": unsupported GGUF version ", version, " (big-endian file?)"));
  }
  ASSIGN_OR_RETURN(uint64_t n_tensors, c.Read<uint64_t>("tensor count"));
  ASSIGN_OR_RETURN(uint64_t n_kv, c.Read<uint64_t>("metadata count"));
  // Each KV takes at least 13 bytes and each tensor info at least 24: reject absurd counts
  // before looping (a corrupt count must not spin for 2^64 iterations).
  if (n_kv > c.file_remaining() / 13 || n_tensors > c.file_remaining() / 24) {
    return absl::DataLossError(absl::StrCat("GGUF file ", path, " is truncated or corrupt: ", n_kv,
                                            " metadata entries and ", n_tensors,
                                            " tensors cannot fit in ", f_.file_size, " bytes"));
  }
  kv_begin_ = c.pos();
  for (uint64_t i = 0; i < n_kv; ++i) {
    ASSIGN_OR_RETURN(absl::string_view key, c.ReadString("metadata key"));
    ASSIGN_OR_RETURN(uint32_t type, c.Read<uint32_t>("metadata type"));
    KvValue v;
    absl::Status s = ReadValue(c, type, v, 0);
    if (!s.ok()) {
      // Keep "truncated" from the cursor, add which key it was.
      return absl::Status(s.code(),
                          absl::StrCat(s.message(), " (metadata key ", key, ", file ", path, ")"));
    }
    // A repeated key is ambiguous (which value wins depends on the reader): refuse the file.
    if (!kv_.emplace(key, v).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("duplicate GGUF metadata key ", key, " in ", path));
    }
  }
  kv_end_ = c.pos();
  uint64_t alignment = 32;
  if (Find("general.alignment") != nullptr) {
    ASSIGN_OR_RETURN(alignment, GetUInt("general.alignment"));
    if (alignment == 0 || (alignment & (alignment - 1)) != 0 || alignment > (1u << 20)) {
      return absl::InvalidArgumentError(absl::StrCat("bad general.alignment ", alignment));
    }
  }
  for (uint64_t i = 0; i < n_tensors; ++i) {
    ASSIGN_OR_RETURN(absl::string_view name, c.ReadString("tensor name"));
    ASSIGN_OR_RETURN(uint32_t n_dims, c.Read<uint32_t>("tensor dimension count"));
    if (n_dims == 0 || n_dims > 4) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", name, " has ", n_dims, " dimensions"));
    }
    TensorInfo ti;
    ti.shape.resize(n_dims);
    for (uint32_t d = 0; d < n_dims; ++d) {
      ASSIGN_OR_RETURN(uint64_t ne, c.Read<uint64_t>("tensor dimensions"));
      if (ne > (uint64_t{1} << 40)) {
        return absl::InvalidArgumentError(
            absl::StrCat("tensor ", name, " dimension ", ne, " too large"));
      }
      ti.shape[n_dims - 1 - d] = static_cast<int64_t>(ne);  // ggml lists ne0 (innermost) first
    }
    ASSIGN_OR_RETURN(ti.type, c.Read<uint32_t>("tensor type"));
    ASSIGN_OR_RETURN(ti.offset, c.Read<uint64_t>("tensor offset"));
    if (ti.offset % alignment != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", name, " offset ", ti.offset, " is not aligned to ", alignment));
    }
    if (!tensors_.emplace(std::string(name), std::move(ti)).second) {
      return absl::InvalidArgumentError(absl::StrCat("duplicate tensor ", name, " in ", path));
    }
    order_.emplace_back(name);
  }
  // The data section starts at the next multiple of the alignment.
  data_start_ = (c.pos() + alignment - 1) / alignment * alignment;
  // A file without tensors (llama.cpp's vocabulary-only files) may end right after the header.
  if (tensors_.empty()) data_start_ = std::min(data_start_, f_.file_size);
  if (data_start_ > f_.file_size) {
    return Truncated(f_, c.pos(), data_start_ - c.pos(), "alignment padding before tensor data");
  }
  // Check every tensor of a type we can size now, used or not, so a cut file is reported as
  // such up front. Other types are reported (Unimplemented) only if the model needs them.
  for (const auto& [name, ti] : tensors_) {
    GgmlBlockLayout l;
    if (TypeBlock(ti.type, &l)) RETURN_IF_ERROR(Extent(name, ti, l).status());
  }
  return absl::OkStatus();
}

absl::StatusOr<const KvValue*> GgufReader::Get(absl::string_view key) const {
  const KvValue* v = Find(key);
  if (v == nullptr) {
    return absl::NotFoundError(absl::StrCat("GGUF key ", key, " not found in ", f_.path));
  }
  return v;
}

absl::StatusOr<uint64_t> GgufReader::GetUInt(absl::string_view key) const {
  ASSIGN_OR_RETURN(const KvValue* v, Get(key));
  bool is_signed = v->type == kI8 || v->type == kI16 || v->type == kI32 || v->type == kI64;
  if (ScalarSize(v->type) == 0 || v->type == kF32 || v->type == kF64 || v->type == kBool) {
    return absl::InvalidArgumentError(absl::StrCat("GGUF key ", key, " is not an integer"));
  }
  if (is_signed && static_cast<int64_t>(v->u) < 0) {
    return absl::InvalidArgumentError(absl::StrCat("GGUF key ", key, " is negative"));
  }
  return v->u;
}

absl::StatusOr<double> GgufReader::GetFloat(absl::string_view key) const {
  ASSIGN_OR_RETURN(const KvValue* v, Get(key));
  if (v->type != kF32 && v->type != kF64) {
    return absl::InvalidArgumentError(absl::StrCat("GGUF key ", key, " is not a float"));
  }
  return v->f;
}

absl::StatusOr<absl::string_view> GgufReader::GetString(absl::string_view key) const {
  ASSIGN_OR_RETURN(const KvValue* v, Get(key));
  if (v->type != kString) {
    return absl::InvalidArgumentError(absl::StrCat("GGUF key ", key, " is not a string"));
  }
  return v->str;
}

absl::StatusOr<bool> GgufReader::GetBool(absl::string_view key) const {
  ASSIGN_OR_RETURN(const KvValue* v, Get(key));
  if (v->type != kBool) {
    return absl::InvalidArgumentError(absl::StrCat("GGUF key ", key, " is not a bool"));
  }
  return v->u != 0;
}

absl::StatusOr<const KvValue*> GgufReader::GetArray(absl::string_view key) const {
  ASSIGN_OR_RETURN(const KvValue* v, Get(key));
  if (v->type != kArray) {
    return absl::InvalidArgumentError(absl::StrCat("GGUF key ", key, " is not an array"));
  }
  return v;
}

absl::StatusOr<std::vector<std::string>> GgufReader::GetStringArray(absl::string_view key) const {
  ASSIGN_OR_RETURN(const KvValue* v, GetArray(key));
  if (v->elem_type != kString) {
    return absl::InvalidArgumentError(absl::StrCat("GGUF key ", key, " is not a string array"));
  }
  Cursor c(f_);  // already walked once in Parse(), so these reads are in bounds
  c.set_pos(v->offset);
  std::vector<std::string> out;
  out.reserve(v->count);
  for (uint64_t i = 0; i < v->count; ++i) {
    ASSIGN_OR_RETURN(absl::string_view s, c.ReadString("string array"));
    out.emplace_back(s);
  }
  return out;
}

absl::StatusOr<std::vector<float>> GgufReader::GetFloatArray(absl::string_view key) const {
  ASSIGN_OR_RETURN(const KvValue* v, GetArray(key));
  if (v->elem_type != kF32) {
    return absl::InvalidArgumentError(absl::StrCat("GGUF key ", key, " is not an f32 array"));
  }
  std::vector<float> out(v->count);
  std::memcpy(out.data(), f_.data + v->offset, v->count * 4);
  return out;
}

absl::StatusOr<std::vector<int32_t>> GgufReader::GetIntArray(absl::string_view key) const {
  ASSIGN_OR_RETURN(const KvValue* v, GetArray(key));
  Cursor c(f_);
  c.set_pos(v->offset);
  if (v->elem_type == kF32 || v->elem_type == kF64 || ScalarSize(v->elem_type) == 0) {
    return absl::InvalidArgumentError(absl::StrCat("GGUF key ", key, " is not an integer array"));
  }
  std::vector<int32_t> out(v->count);
  for (uint64_t i = 0; i < v->count; ++i) {
    KvValue e;
    RETURN_IF_ERROR(ReadValue(c, v->elem_type, e, 0));
    out[i] = static_cast<int32_t>(e.u);
  }
  return out;
}

absl::StatusOr<uint64_t> GgufReader::Extent(const std::string& name, const TensorInfo& ti,
                                            const GgmlBlockLayout& l) const {
  // Dimensions are each <= 2^40 and there are at most 4: check the product for overflow.
  uint64_t numel = 1;
  for (int64_t d : ti.shape) {
    if (__builtin_mul_overflow(numel, static_cast<uint64_t>(d), &numel)) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", name, " is too large"));
    }
  }
  // Blocks never straddle rows: the innermost dimension is a whole number of blocks.
  if (l.values > 1 && (ti.shape.back() % l.values) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor ", name, " has ggml type ", GgmlTypeName(ti.type), " but rows of ",
        ti.shape.back(), " values, not a whole number of ", l.values, "-value blocks"));
  }
  uint64_t nbytes;
  if (__builtin_mul_overflow(numel / static_cast<uint64_t>(l.values), uint64_t{l.bytes},
                             &nbytes)) {
    return absl::InvalidArgumentError(absl::StrCat("tensor ", name, " is too large"));
  }
  size_t avail = f_.file_size - data_start_;
  if (ti.offset > avail || nbytes > avail - ti.offset) {
    return absl::DataLossError(absl::StrCat(
        "GGUF file ", f_.path, " is truncated: tensor ", name, " needs ", nbytes,
        " bytes at offset ", data_start_ + ti.offset, " of a ", f_.file_size, "-byte file"));
  }
  return nbytes;
}

absl::Status GgufReader::GetTensor(const std::string& name, TensorView* t,
                                   std::vector<std::vector<uint8_t>>* owned,
                                   DType dequant_to) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    return absl::InvalidArgumentError(absl::StrCat("missing tensor ", name, " in ", f_.path));
  }
  const TensorInfo& ti = it->second;
  GgmlBlockLayout l;
  const bool quantized = GgmlQuantLayout(ti.type, &l);
  if (!(quantized && owned != nullptr) && !ToDType(ti.type, &t->dtype)) {
    return absl::UnimplementedError(absl::StrCat(
        "tensor ", name, " has ggml type ", GgmlTypeName(ti.type), " (", ti.type,
        "); only F32, F16, BF16, Q8_0, Q4_0, Q4_K and Q6_K are supported"));
  }
  if (!quantized) TypeBlock(ti.type, &l);
  ASSIGN_OR_RETURN(uint64_t nbytes, Extent(name, ti, l));
  if (data_start_ + ti.offset + nbytes > f_.size) {
    return absl::InternalError(absl::StrCat("tensor ", name, " data is not loaded (header only)"));
  }
  t->name = name;
  t->shape = ti.shape;
  t->data = f_.data + data_start_ + ti.offset;
  t->nbytes = nbytes;
  if (!quantized) return absl::OkStatus();
  // Dequantize into the requested dtype (fp32 first, then narrowed in place row by row).
  const int64_t n = t->numel();
  std::vector<uint8_t>& buf = owned->emplace_back();
  buf.resize(static_cast<size_t>(n) * DTypeSize(dequant_to));
  std::vector<float> row;
  const int64_t cols = ti.shape.back();
  const int64_t rows = cols == 0 ? 0 : n / cols;
  const size_t row_bytes = static_cast<size_t>(cols / l.values) * l.bytes;
  const auto* src = static_cast<const uint8_t*>(t->data);
  row.resize(static_cast<size_t>(cols));
  for (int64_t r = 0; r < rows; ++r) {
    absl::Status s = DequantizeGgml(ti.type, src + r * row_bytes, row_bytes, cols, row.data());
    if (!s.ok()) return absl::Status(s.code(), absl::StrCat("tensor ", name, ": ", s.message()));
    uint8_t* dst = buf.data() + static_cast<size_t>(r * cols) * DTypeSize(dequant_to);
    switch (dequant_to) {
      case DType::kF32:
        std::memcpy(dst, row.data(), static_cast<size_t>(cols) * 4);
        break;
      case DType::kF16:
        for (int64_t i = 0; i < cols; ++i) {
          const uint16_t h = F32ToHalfBits(row[i]);
          std::memcpy(dst + 2 * i, &h, 2);
        }
        break;
      case DType::kBF16:
        for (int64_t i = 0; i < cols; ++i) {
          uint32_t u;
          std::memcpy(&u, &row[i], 4);
          u += 0x7FFF + ((u >> 16) & 1);  // to nearest, ties to even (values are finite here)
          const auto b = static_cast<uint16_t>(u >> 16);
          std::memcpy(dst + 2 * i, &b, 2);
        }
        break;
    }
  }
  t->dtype = dequant_to;
  t->data = buf.data();
  t->nbytes = buf.size();
  return absl::OkStatus();
}

// Config keys: "<arch>.<suffix>".
absl::StatusOr<int> GetInt(const GgufReader& r, const std::string& key) {
  ASSIGN_OR_RETURN(uint64_t v, r.GetUInt(key));
  if (v > (1u << 30)) {
    return absl::InvalidArgumentError(absl::StrCat("GGUF key ", key, " = ", v, " too large"));
  }
  return static_cast<int>(v);
}

// A GGUF token id key: absent gives def; ids are stored as u32 and 0xFFFFFFFF or any other
// out-of-range value means "none" (-1).
absl::StatusOr<int32_t> GgufTokenId(const GgufReader& r, const char* key, size_t n, int32_t def) {
  if (r.Find(key) == nullptr) return def;
  ASSIGN_OR_RETURN(uint64_t x, r.GetUInt(key));
  return x < n ? static_cast<int32_t>(x) : -1;
}

// tokenizer.ggml.model "gpt2": byte-level BPE with merges, split by the pre-tokenizer that
// tokenizer.ggml.pre names (llama.cpp's "default" when absent).
absl::StatusOr<std::unique_ptr<Tokenizer>> GgufByteLevelTokenizer(const GgufReader& r) {
  ByteLevelVocab v;
  ASSIGN_OR_RETURN(v.tokens, r.GetStringArray("tokenizer.ggml.tokens"));
  const size_t n = v.tokens.size();
  if (r.Find("tokenizer.ggml.token_type") != nullptr) {
    ASSIGN_OR_RETURN(v.types, r.GetIntArray("tokenizer.ggml.token_type"));
  }
  if (r.Find("tokenizer.ggml.merges") == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(r.path(), ": a gpt2 tokenizer needs tokenizer.ggml.merges"));
  }
  ASSIGN_OR_RETURN(v.merges, r.GetStringArray("tokenizer.ggml.merges"));
  std::string pre = "default";
  if (r.Find("tokenizer.ggml.pre") != nullptr) {
    ASSIGN_OR_RETURN(absl::string_view p, r.GetString("tokenizer.ggml.pre"));
    pre = std::string(p);
  }
  RETURN_IF_ERROR(ByteLevelPreTokenizer(pre, &v));
  ASSIGN_OR_RETURN(v.bos_id, GgufTokenId(r, "tokenizer.ggml.bos_token_id", n, -1));
  // Qwen2-style files name a BOS token but never add it (llama.cpp follows add_bos_token).
  if (r.Find("tokenizer.ggml.add_bos_token") != nullptr) {
    ASSIGN_OR_RETURN(bool add_bos, r.GetBool("tokenizer.ggml.add_bos_token"));
    if (!add_bos) v.bos_id = -1;
  }
  ASSIGN_OR_RETURN(v.eos_id, GgufTokenId(r, "tokenizer.ggml.eos_token_id", n, -1));
  ASSIGN_OR_RETURN(v.unk_id, GgufTokenId(r, "tokenizer.ggml.unknown_token_id", n, -1));
  for (const char* key : {"tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"}) {
    ASSIGN_OR_RETURN(int32_t id, GgufTokenId(r, key, n, -1));
    if (id >= 0) v.extra_stop_ids.push_back(id);
  }
  // Older conversions lack eot_token_id: the end-of-turn tokens of the common families.
  for (size_t i = 0; i < n; ++i) {
    const std::string& t = v.tokens[i];
    if (t == "<|eot_id|>" || t == "<|eom_id|>" || t == "<|im_end|>" || t == "<|endoftext|>")
      v.extra_stop_ids.push_back(static_cast<int32_t>(i));
  }
  auto tok = MakeByteLevelTokenizer(std::move(v));
  if (!tok.ok()) {
    return absl::Status(tok.status().code(),
                        absl::StrCat(r.path(), ": ", tok.status().message()));
  }
  return tok;
}

absl::StatusOr<std::unique_ptr<Tokenizer>> GgufTokenizer(const GgufReader& r) {
  if (r.Find("tokenizer.ggml.model") == nullptr) {
    return absl::NotFoundError("GGUF file has no tokenizer (tokenizer.ggml.model is missing)");
  }
  ASSIGN_OR_RETURN(absl::string_view model, r.GetString("tokenizer.ggml.model"));
  if (model == "gpt2") return GgufByteLevelTokenizer(r);
  if (model != "llama") {
    return absl::UnimplementedError(absl::StrCat("GGUF tokenizer model \"", model,
                                                 "\" is not supported (only \"llama\" and \"gpt2\")"));
  }
  SpmVocab v;
  ASSIGN_OR_RETURN(v.pieces, r.GetStringArray("tokenizer.ggml.tokens"));
  const size_t n = v.pieces.size();
  if (r.Find("tokenizer.ggml.scores") != nullptr) {
    ASSIGN_OR_RETURN(v.scores, r.GetFloatArray("tokenizer.ggml.scores"));
  } else {
    v.scores.assign(n, 0.0f);
  }
  if (r.Find("tokenizer.ggml.token_type") != nullptr) {
    ASSIGN_OR_RETURN(v.types, r.GetIntArray("tokenizer.ggml.token_type"));
  } else {
    v.types.assign(n, 1);  // normal
  }
  if (v.scores.size() != n || v.types.size() != n) {
    return absl::InvalidArgumentError(absl::StrCat("GGUF tokenizer has ", n, " tokens but ",
                                                   v.scores.size(), " scores and ", v.types.size(),
                                                   " token types"));
  }
  auto id = [&](const char* key, int32_t def) { return GgufTokenId(r, key, n, def); };
  ASSIGN_OR_RETURN(v.bos_id, id("tokenizer.ggml.bos_token_id", 1));
  ASSIGN_OR_RETURN(v.eos_id, id("tokenizer.ggml.eos_token_id", 2));
  ASSIGN_OR_RETURN(v.unk_id, id("tokenizer.ggml.unknown_token_id", 0));
  if (r.Find("tokenizer.ggml.add_space_prefix") != nullptr) {
    ASSIGN_OR_RETURN(v.add_space_prefix, r.GetBool("tokenizer.ggml.add_space_prefix"));
  }
  return MakeSpmTokenizer(std::move(v));
}

// tokenizer.chat_template and the text of the BOS / EOS tokens it is rendered with.
absl::Status GgufChatTemplate(const GgufReader& r, ModelInfo* info) {
  if (r.Find("tokenizer.chat_template") == nullptr) return absl::OkStatus();
  ASSIGN_OR_RETURN(absl::string_view t, r.GetString("tokenizer.chat_template"));
  info->chat_template = std::string(t);
  ASSIGN_OR_RETURN(std::vector<std::string> tokens, r.GetStringArray("tokenizer.ggml.tokens"));
  const auto text = [&](const char* key, std::string* out) -> absl::Status {
    if (r.Find(key) == nullptr) return absl::OkStatus();
    ASSIGN_OR_RETURN(uint64_t id, r.GetUInt(key));
    if (id < tokens.size()) *out = tokens[id];
    return absl::OkStatus();
  };
  RETURN_IF_ERROR(text("tokenizer.ggml.bos_token_id", &info->bos_token));
  return text("tokenizer.ggml.eos_token_id", &info->eos_token);
}

// An f64 value beyond float's range becomes inf (the conversion itself would be undefined);
// ValidateConfig then refuses it.
float ToF32Checked(double d) {
  if (std::isnan(d)) return std::numeric_limits<float>::quiet_NaN();
  if (std::fabs(d) > std::numeric_limits<float>::max()) {
    return d > 0 ? std::numeric_limits<float>::infinity() : -std::numeric_limits<float>::infinity();
  }
  return static_cast<float>(d);
}

// The model configuration from GGUF metadata and tensor shapes (no tensor data is read).
absl::Status GgufConfig(const GgufReader& r, ModelConfig& c) {
  const std::string& path = r.path();
  ASSIGN_OR_RETURN(absl::string_view arch, r.GetString("general.architecture"));
  if (arch != "llama") {
    return absl::UnimplementedError(absl::StrCat("GGUF architecture \"", arch, "\" of ", path,
                                                 " is not supported (only llama)"));
  }
  // llama.cpp stores Llama-3.1 rope scaling as per-frequency factors in a tensor; applying it
  // is not implemented, and ignoring it would silently give wrong long-context results.
  if (r.HasTensor("rope_freqs.weight")) {
    return absl::UnimplementedError(
        absl::StrCat(path, " has rope_freqs.weight (GGUF rope scaling), which is not supported"));
  }
  if (r.Find("llama.rope.scaling.type") != nullptr) {
    ASSIGN_OR_RETURN(absl::string_view type, r.GetString("llama.rope.scaling.type"));
    if (type != "none") {
      return absl::UnimplementedError(
          absl::StrCat("GGUF rope scaling type \"", type, "\" is not supported"));
    }
  }
  c.architecture = "llama";
  c.rope_layout = RopeLayout::kAdjacentPairs;  // converters permute Q/K rows into this order
  ASSIGN_OR_RETURN(c.dim, GetInt(r, "llama.embedding_length"));
  ASSIGN_OR_RETURN(c.ffn_dim, GetInt(r, "llama.feed_forward_length"));
  ASSIGN_OR_RETURN(c.n_layers, GetInt(r, "llama.block_count"));
  ASSIGN_OR_RETURN(c.n_heads, GetInt(r, "llama.attention.head_count"));
  c.n_kv_heads = c.n_heads;
  if (r.Find("llama.attention.head_count_kv") != nullptr) {
    ASSIGN_OR_RETURN(c.n_kv_heads, GetInt(r, "llama.attention.head_count_kv"));
  }
  if (r.Find("llama.context_length") != nullptr) {
    ASSIGN_OR_RETURN(c.max_seq_len, GetInt(r, "llama.context_length"));
    c.trained_context_length = c.max_seq_len;
  }
  if (r.Find("llama.attention.layer_norm_rms_epsilon") != nullptr) {
    ASSIGN_OR_RETURN(double eps, r.GetFloat("llama.attention.layer_norm_rms_epsilon"));
    c.rms_eps = ToF32Checked(eps);
  }
  if (r.Find("llama.rope.freq_base") != nullptr) {
    ASSIGN_OR_RETURN(double theta, r.GetFloat("llama.rope.freq_base"));
    c.rope_theta = ToF32Checked(theta);
  }
  if (c.n_heads <= 0) return absl::InvalidArgumentError("llama.attention.head_count is 0");
  c.head_dim = c.dim / c.n_heads;
  if (r.Find("llama.attention.key_length") != nullptr) {
    ASSIGN_OR_RETURN(c.head_dim, GetInt(r, "llama.attention.key_length"));
  }
  if (r.Find("llama.rope.dimension_count") != nullptr) {
    ASSIGN_OR_RETURN(int rot, GetInt(r, "llama.rope.dimension_count"));
    if (rot != c.head_dim) {
      return absl::UnimplementedError(
          absl::StrCat("partial rotary embedding (rope.dimension_count ", rot, " != head_dim ",
                       c.head_dim, ") is not supported"));
    }
  }

  c.tied_embeddings = !r.HasTensor("output.weight");
  const std::vector<int64_t> emb = r.TensorShape("token_embd.weight");
  c.vocab_size = static_cast<int>(emb.empty() ? 0 : emb[0]);
  if (r.Find("llama.vocab_size") != nullptr) {
    ASSIGN_OR_RETURN(c.vocab_size, GetInt(r, "llama.vocab_size"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Model>> LoadGguf(const std::string& path,
                                                const LoadOptions& options) {
  auto m = std::make_unique<Model>();
  ASSIGN_OR_RETURN(std::unique_ptr<MappedFile> file, MappedFile::Open(path));
  GgufReader r(GgufBytes{file->data(), file->size(), file->size(), path});
  RETURN_IF_ERROR(r.Parse());

  RETURN_IF_ERROR(GgufConfig(r, m->config_));
  ModelConfig& c = m->config_;

  ModelWeights& w = m->weights_;
  const auto get = [&](const std::string& name, TensorView* t) {
    return r.GetTensor(name, t, &m->owned_, options.dequantize_to);
  };
  RETURN_IF_ERROR(get("token_embd.weight", &w.tok_embeddings));
  RETURN_IF_ERROR(get("output_norm.weight", &w.final_norm));
  if (c.tied_embeddings) {
    w.output = w.tok_embeddings;
  } else {
    RETURN_IF_ERROR(get("output.weight", &w.output));
  }
  // Nine tensors per block: a corrupt block_count must not size a huge allocation.
  if (static_cast<uint64_t>(c.n_layers) * 9 > r.num_tensors()) {
    return absl::InvalidArgumentError(absl::StrCat("llama.block_count ", c.n_layers, " but only ",
                                                   r.num_tensors(), " tensors in ", path));
  }
  w.layers.resize(c.n_layers);
  for (int i = 0; i < c.n_layers; ++i) {
    LayerWeights& l = w.layers[i];
    const std::string p = absl::StrCat("blk.", i, ".");
    RETURN_IF_ERROR(get(p + "attn_norm.weight", &l.attn_norm));
    RETURN_IF_ERROR(get(p + "attn_q.weight", &l.wq));
    RETURN_IF_ERROR(get(p + "attn_k.weight", &l.wk));
    RETURN_IF_ERROR(get(p + "attn_v.weight", &l.wv));
    RETURN_IF_ERROR(get(p + "attn_output.weight", &l.wo));
    RETURN_IF_ERROR(get(p + "ffn_norm.weight", &l.ffn_norm));
    RETURN_IF_ERROR(get(p + "ffn_gate.weight", &l.w_gate));
    RETURN_IF_ERROR(get(p + "ffn_up.weight", &l.w_up));
    RETURN_IF_ERROR(get(p + "ffn_down.weight", &l.w_down));
  }
  ASSIGN_OR_RETURN(m->tokenizer_, GgufTokenizer(r));
  m->source_ = path;
  m->files_.push_back(std::move(file));
  RETURN_IF_ERROR(FinalizeModel(*m));
  return m;
}

namespace {

// Reads a growing prefix of the file until the metadata and tensor infos parse, then calls
// use(reader): the weights (most of the file) are never read or mapped.
template <typename T, typename Use>
absl::StatusOr<T> WithGgufHeader(const std::string& path, Use use) {
  // O_NONBLOCK: a FIFO must not block the open (it is refused just below, as is anything but a
  // regular file); reads of a regular file are unaffected.
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    return absl::NotFoundError(absl::StrCat("cannot open ", path, ": ", std::strerror(errno)));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(
        path, S_ISFIFO(st.st_mode)  ? " is a FIFO"
              : S_ISDIR(st.st_mode) ? " is a directory"
                                    : " is not a regular file",
        "; only regular files can be read"));
  }
  const size_t file_size = static_cast<size_t>(st.st_size);
  std::vector<uint8_t> buf;
  size_t want = std::min<size_t>(file_size, size_t{4} << 20);
  for (;;) {
    const size_t have = buf.size();
    buf.resize(want);
    size_t got = have;
    while (got < want) {
      ssize_t n = ::pread(fd, buf.data() + got, want - got, static_cast<off_t>(got));
      if (n <= 0) break;
      got += static_cast<size_t>(n);
    }
    buf.resize(got);
    GgufReader r(GgufBytes{buf.data(), buf.size(), file_size, path});
    absl::Status s = r.Parse();
    if (s.code() == absl::StatusCode::kOutOfRange && got == want && want < file_size) {
      want = std::min(file_size, want * 2);
      continue;
    }
    ::close(fd);
    RETURN_IF_ERROR(s);
    return use(r);
  }
}

}  // namespace

absl::StatusOr<ModelInfo> LoadGgufInfo(const std::string& path) {
  return WithGgufHeader<ModelInfo>(path, [&](const GgufReader& r) -> absl::StatusOr<ModelInfo> {
    ModelInfo info;
    RETURN_IF_ERROR(GgufConfig(r, info.config));
    ASSIGN_OR_RETURN(info.tokenizer, GgufTokenizer(r));
    RETURN_IF_ERROR(GgufChatTemplate(r, &info));
    info.source = path;
    return info;
  });
}

absl::StatusOr<std::unique_ptr<Tokenizer>> LoadGgufTokenizer(const std::string& path) {
  return WithGgufHeader<std::unique_ptr<Tokenizer>>(
      path, [](const GgufReader& r) { return GgufTokenizer(r); });
}

absl::Status QuantizeGgufFile(const std::string& in, const std::string& out,
                              uint32_t ggml_type) {
  GgmlBlockLayout q;
  if (!GgmlQuantLayout(ggml_type, &q)) {
    return absl::InvalidArgumentError(absl::StrCat("cannot quantize to ggml type ", ggml_type));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<MappedFile> file, MappedFile::Open(in));
  GgufReader r(GgufBytes{file->data(), file->size(), file->size(), in});
  RETURN_IF_ERROR(r.Parse());
  uint64_t alignment = 32;
  if (r.Find("general.alignment") != nullptr) {
    ASSIGN_OR_RETURN(alignment, r.GetUInt("general.alignment"));
  }
  std::string o;
  const auto put = [&o](const void* p, size_t n) { o.append(static_cast<const char*>(p), n); };
  const auto put_u32 = [&](uint32_t v) { put(&v, 4); };
  const auto put_u64 = [&](uint64_t v) { put(&v, 8); };
  put(file->data(), 24);  // magic, version, tensor count, metadata count
  put(file->data() + r.kv_begin(), r.kv_end() - r.kv_begin());
  // Each tensor's new bytes: quantized from fp32, or copied as stored.
  std::vector<std::string> data;
  std::vector<uint32_t> types;
  for (const std::string& name : r.tensor_order()) {
    const TensorInfo& ti = r.info(name);
    TensorView t;
    const bool convert = ti.shape.size() >= 2 && ti.shape.back() % q.values == 0 &&
                         (ti.type == kGgmlF32 || ti.type == kGgmlF16 || ti.type == kGgmlBF16);
    RETURN_IF_ERROR(r.GetTensor(name, &t));  // Unimplemented for a type it cannot read
    if (!convert) {
      data.emplace_back(static_cast<const char*>(t.data), t.nbytes);
      types.push_back(ti.type);
      continue;
    }
    std::vector<float> f(static_cast<size_t>(t.numel()));
    t.ToF32(f.data());
    std::vector<uint8_t> blocks;
    absl::Status s = QuantizeGgml(ggml_type, f.data(), t.numel(), &blocks);
    if (!s.ok()) return absl::Status(s.code(), absl::StrCat("tensor ", name, ": ", s.message()));
    data.emplace_back(reinterpret_cast<const char*>(blocks.data()), blocks.size());
    types.push_back(ggml_type);
  }
  uint64_t offset = 0;
  for (size_t i = 0; i < data.size(); ++i) {
    const std::string& name = r.tensor_order()[i];
    const TensorInfo& ti = r.info(name);
    put_u64(name.size());
    put(name.data(), name.size());
    put_u32(static_cast<uint32_t>(ti.shape.size()));
    for (size_t d = ti.shape.size(); d-- > 0;) put_u64(static_cast<uint64_t>(ti.shape[d]));
    put_u32(types[i]);
    put_u64(offset);
    offset += (data[i].size() + alignment - 1) / alignment * alignment;
  }
  o.resize((o.size() + alignment - 1) / alignment * alignment, '\0');
  for (const std::string& d : data) {
    o += d;
    o.resize((o.size() + alignment - 1) / alignment * alignment, '\0');
  }
  const std::string tmp = out + ".tmp";
  FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr) {
    return absl::PermissionDeniedError(absl::StrCat("cannot write ", tmp, ": ", std::strerror(errno)));
  }
  const bool ok = std::fwrite(o.data(), 1, o.size(), f) == o.size();
  if (std::fclose(f) != 0 || !ok || std::rename(tmp.c_str(), out.c_str()) != 0) {
    std::remove(tmp.c_str());
    return absl::DataLossError(absl::StrCat("cannot write ", out));
  }
  return absl::OkStatus();
}

}  // namespace sparsex
