#include "model/chat_template.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <functional>
#include <limits>
#include <optional>
#include <unordered_map>
#include <utility>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"

namespace sparsex {
namespace {

using json = nlohmann::json;

// Errors unwind the parser and the tree walker as this one type; the public API catches it
// and returns INVALID_ARGUMENT, so nothing is thrown past this file.
struct TemplateError {
  std::string message;
};

[[noreturn]] void Fail(int line, const std::string& message) {
  throw TemplateError{line > 0 ? absl::StrCat(message, " (line ", line, ")") : message};
}

// ---------------------------------------------------------------------------------------------
// Values: Python's object model as far as templates see it.

struct Value;
using ValueList = std::vector<Value>;

// Lists and dicts nest at most this deep: printing, comparing, serializing and destroying a
// value recurse through it (a template could otherwise build [[[...]]] a million deep).
constexpr int kMaxValueDepth = 256;
struct ValueDict;
struct Func;

struct Value {
  enum class K : uint8_t { kUndefined, kNone, kBool, kInt, kFloat, kString, kList, kDict, kFunc };
  K k = K::kUndefined;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;  // kString; kUndefined: why it is undefined, the error message if it is used
  std::shared_ptr<const ValueList> list;
  std::shared_ptr<ValueDict> dict;  // shared: namespace() objects are mutated through it
  std::shared_ptr<const Func> fn;
  int depth = 0;  // lists and dicts: 1 + their deepest element (a namespace counts as 1)
  bool tuple = false;  // kList: a Python tuple (dict items, (a, b)): printed "(a, b)"

  static Value Undefined(std::string what) {
    Value v;
    v.s = std::move(what);
    return v;
  }
  static Value None() { Value v; v.k = K::kNone; return v; }
  static Value Bool(bool x) { Value v; v.k = K::kBool; v.b = x; return v; }
  static Value Int(int64_t x) { Value v; v.k = K::kInt; v.i = x; return v; }
  static Value Float(double x) { Value v; v.k = K::kFloat; v.f = x; return v; }
  static Value Str(std::string x) { Value v; v.k = K::kString; v.s = std::move(x); return v; }
  static Value List(ValueList x) {
    Value v;
    v.k = K::kList;
    v.depth = 1;
    for (const Value& e : x) v.depth = std::max(v.depth, e.depth + 1);
    if (v.depth > kMaxValueDepth) Fail(0, "a list nested deeper than 256 levels");
    v.list = std::make_shared<const ValueList>(std::move(x));
    return v;
  }
  static Value Tuple(ValueList x) {
    Value v = List(std::move(x));
    v.tuple = true;
    return v;
  }
  bool undefined() const { return k == K::kUndefined; }
  bool is_str() const { return k == K::kString; }
  bool numeric() const { return k == K::kBool || k == K::kInt || k == K::kFloat; }
  double num() const { return k == K::kFloat ? f : k == K::kInt ? static_cast<double>(i) : b; }
  int64_t integer() const { return k == K::kInt ? i : b; }  // for kInt / kBool
};

// Insertion-ordered like Python's dict; templates' dicts are small, so lookups are linear.
struct ValueDict {
  std::vector<std::pair<std::string, Value>> items;
  bool ns = false;  // a namespace(): attributes may be assigned
  const Value* Find(const std::string& key) const {
    for (const auto& [k, v] : items) {
      if (k == key) return &v;
    }
    return nullptr;
  }
  void Set(const std::string& key, Value v) {
    for (auto& [k, old] : items) {
      if (k == key) {
        old = std::move(v);
        return;
      }
    }
    items.emplace_back(key, std::move(v));
  }
};

Value MakeDict(std::vector<std::pair<std::string, Value>> items, bool ns = false) {
  Value v;
  v.k = Value::K::kDict;
  v.depth = 1;
  for (const auto& [k, e] : items) v.depth = std::max(v.depth, e.depth + 1);
  if (ns) v.depth = 1;  // opaque: nothing recurses into a namespace
  if (v.depth > kMaxValueDepth) Fail(0, "a dict nested deeper than 256 levels");
  v.dict = std::make_shared<ValueDict>();
  v.dict->items = std::move(items);
  v.dict->ns = ns;
  return v;
}

struct CallArgs {
  std::vector<Value> pos;
  std::vector<std::pair<std::string, Value>> kw;
  int line = 0;
  // Positional index `i` or keyword `name`; nullopt when neither was given.
  std::optional<Value> Get(size_t i, const char* name) const {
    if (i < pos.size()) return pos[i];
    for (const auto& [k, v] : kw) {
      if (k == name) return v;
    }
    return std::nullopt;
  }
};

struct Func {
  std::string name;
  std::function<Value(const CallArgs&)> call;
};

Value MakeFunc(std::string name, std::function<Value(const CallArgs&)> call) {
  Value v;
  v.k = Value::K::kFunc;
  v.fn = std::make_shared<const Func>(Func{std::move(name), std::move(call)});
  return v;
}

const char* TypeName(const Value& v) {
  switch (v.k) {
    case Value::K::kUndefined: return "Undefined";
    case Value::K::kNone: return "NoneType";
    case Value::K::kBool: return "bool";
    case Value::K::kInt: return "int";
    case Value::K::kFloat: return "float";
    case Value::K::kString: return "str";
    case Value::K::kList: return "list";
    case Value::K::kDict: return v.dict->ns ? "Namespace" : "dict";
    case Value::K::kFunc: return "function";
  }
  return "?";
}

[[noreturn]] void FailUndefined(const Value& v, int line) {
  Fail(line, v.s.empty() ? "undefined value used" : v.s);
}

bool Truthy(const Value& v) {
  switch (v.k) {
    case Value::K::kUndefined:
    case Value::K::kNone: return false;
    case Value::K::kBool: return v.b;
    case Value::K::kInt: return v.i != 0;
    case Value::K::kFloat: return v.f != 0;
    case Value::K::kString: return !v.s.empty();
    case Value::K::kList: return !v.list->empty();
    case Value::K::kDict: return v.dict->ns || !v.dict->items.empty();
    case Value::K::kFunc: return true;
  }
  return false;
}

// --- UTF-8: Python strings index, slice and strip code points.

size_t CharLen(unsigned char c) {
  return c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
}

// Byte offsets of each code point, plus the end.
std::vector<size_t> CharOffsets(const std::string& s) {
  std::vector<size_t> o;
  for (size_t p = 0; p < s.size(); p += CharLen(static_cast<unsigned char>(s[p]))) o.push_back(p);
  o.push_back(s.size());  // a truncated last character ends at the end of the string
  return o;
}

uint32_t DecodeAt(const std::string& s, size_t p, size_t* len) {
  const unsigned char c = s[p];
  size_t n = std::min(CharLen(c), s.size() - p);
  *len = n;
  if (n == 1) return c < 0x80 ? c : 0xFFFD;  // a stray byte of invalid UTF-8
  uint32_t cp = c & (0xFF >> (n + 1));
  for (size_t k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[p + k]) & 0x3F);
  return cp;
}

// Python's str.isspace() set.
bool PySpace(uint32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 ||
         c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 ||
         c == 0x202F || c == 0x205F || c == 0x3000;
}

// str.strip / lstrip / rstrip: `chars` nullopt strips whitespace.
std::string Strip(const std::string& s, const std::optional<std::string>& chars, bool left,
                  bool right) {
  std::vector<uint32_t> set;
  if (chars) {
    for (size_t p = 0, n = 0; p < chars->size(); p += n) set.push_back(DecodeAt(*chars, p, &n));
  }
  auto strip_it = [&](uint32_t c) {
    return chars ? std::find(set.begin(), set.end(), c) != set.end() : PySpace(c);
  };
  // Scans inward from both ends (no offsets table: trim runs on every message's content).
  size_t a = 0, b = s.size(), n = 0;
  while (left && a < b && strip_it(DecodeAt(s, a, &n))) a += n;
  while (right && b > a) {
    size_t k = b - 1;
    while (k > a && b - k < 4 && (static_cast<unsigned char>(s[k]) & 0xC0) == 0x80) --k;
    const uint32_t c = DecodeAt(s, k, &n);
    if (k + n != b || !strip_it(c)) break;  // (an invalid sequence is not whitespace)
    b = k;
  }
  return s.substr(a, b - a);
}

// One code point's upper / lower case for Latin-1, Latin Extended-A, Greek and Cyrillic (the
// scripts Python maps by simple rules here); other code points are unchanged.
uint32_t CaseOf(uint32_t c, bool upper) {
  if (c < 0x80) return upper ? std::toupper(c) : std::tolower(c);
  if (upper) {
    if ((c >= 0xE0 && c <= 0xFE && c != 0xF7) || (c >= 0x3B1 && c <= 0x3C9 && c != 0x3C2) ||
        (c >= 0x430 && c <= 0x44F)) {
      return c - 0x20;
    }
    if (c == 0xFF) return 0x178;
    if (c == 0xB5) return 0x39C;
    if (c == 0x3C2) return 0x3A3;
    if (c >= 0x450 && c <= 0x45F) return c - 0x50;
    if (((c >= 0x100 && c <= 0x137) || (c >= 0x14A && c <= 0x177)) && (c & 1)) return c - 1;
    if (((c >= 0x139 && c <= 0x148) || (c >= 0x179 && c <= 0x17E)) && !(c & 1)) return c - 1;
    return c;
  }
  if ((c >= 0xC0 && c <= 0xDE && c != 0xD7) || (c >= 0x391 && c <= 0x3A9 && c != 0x3A2) ||
      (c >= 0x410 && c <= 0x42F)) {
    return c + 0x20;
  }
  if (c == 0x178) return 0xFF;
  if (c >= 0x400 && c <= 0x40F) return c + 0x50;
  if (c == 0x130) return c;  // Python lowers it to two code points; left as is
  if (((c >= 0x100 && c <= 0x137) || (c >= 0x14A && c <= 0x177)) && !(c & 1)) return c + 1;
  if (((c >= 0x139 && c <= 0x148) || (c >= 0x179 && c <= 0x17E)) && (c & 1)) return c + 1;
  return c;
}

void AppendUtf8(uint32_t cp, std::string* o);

// str.upper() / str.lower() (ß upper-cases to "SS" as in Python).
std::string CaseMap(const std::string& s, bool upper) {
  std::string o;
  o.reserve(s.size());
  for (size_t p = 0, n = 0; p < s.size(); p += n) {
    const uint32_t c = DecodeAt(s, p, &n);
    if (n == 1 && static_cast<unsigned char>(s[p]) >= 0x80) {  // invalid UTF-8: unchanged
      o += s[p];
    } else if (upper && c == 0xDF) {
      o += "SS";
    } else {
      AppendUtf8(CaseOf(c, upper), &o);
    }
  }
  return o;
}

// --- str() and repr() of values, as Python prints them.

std::string PyFloat(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d < 0 ? "-inf" : "inf";
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof(buf), d, std::chars_format::scientific);
  std::string sci(buf, r.ptr);  // shortest round trip: "-1.5e+02"
  std::string sign;
  if (sci[0] == '-') {
    sign = "-";
    sci.erase(0, 1);
  }
  const size_t e = sci.find('e');
  std::string digits = sci.substr(0, e);
  digits.erase(std::remove(digits.begin(), digits.end(), '.'), digits.end());
  const int exp = std::stoi(sci.substr(e + 1));
  std::string out;
  if (exp >= -4 && exp < 16) {
    if (exp >= 0) {
      std::string ip = digits.substr(0, std::min<size_t>(digits.size(), exp + 1));
      ip.append(exp + 1 - ip.size(), '0');
      std::string fp = digits.size() > static_cast<size_t>(exp + 1) ? digits.substr(exp + 1) : "0";
      out = ip + "." + fp;
    } else {
      out = "0." + std::string(-exp - 1, '0') + digits;
    }
  } else {
    out = digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    out += absl::StrCat("e", exp < 0 ? "-" : "+", std::abs(exp) < 10 ? "0" : "", std::abs(exp));
  }
  return sign + out;
}

std::string Repr(const Value& v);

std::string ToStr(const Value& v) {
  switch (v.k) {
    case Value::K::kUndefined: return "";
    case Value::K::kNone: return "None";
    case Value::K::kBool: return v.b ? "True" : "False";
    case Value::K::kInt: return std::to_string(v.i);
    case Value::K::kFloat: return PyFloat(v.f);
    case Value::K::kString: return v.s;
    case Value::K::kList: {
      std::string o = v.tuple ? "(" : "[";
      for (size_t k = 0; k < v.list->size(); ++k) o += (k ? ", " : "") + Repr((*v.list)[k]);
      if (v.tuple && v.list->size() == 1) o += ",";
      return o + (v.tuple ? ")" : "]");
    }
    case Value::K::kDict: {
      if (v.dict->ns) return "<Namespace>";
      std::string o = "{";
      bool first = true;
      for (const auto& [k, x] : v.dict->items) {
        o += (first ? "" : ", ") + Repr(Value::Str(k)) + ": " + Repr(x);
        first = false;
      }
      return o + "}";
    }
    case Value::K::kFunc: return "<function " + v.fn->name + ">";
  }
  return "";
}

std::string Repr(const Value& v) {
  if (!v.is_str()) return ToStr(v);
  const bool dq = v.s.find('\'') != std::string::npos && v.s.find('"') == std::string::npos;
  const char q = dq ? '"' : '\'';
  std::string o(1, q);
  for (unsigned char c : v.s) {
    if (c == '\\' || c == q) {
      o += '\\';
      o += static_cast<char>(c);
    } else if (c == '\n') {
      o += "\\n";
    } else if (c == '\r') {
      o += "\\r";
    } else if (c == '\t') {
      o += "\\t";
    } else if (c < 0x20 || c == 0x7F) {
      char b[8];
      std::snprintf(b, sizeof(b), "\\x%02x", c);
      o += b;
    } else {
      o += static_cast<char>(c);
    }
  }
  return o + q;
}

// json.dumps(x, ensure_ascii=False, indent=indent), as transformers' tojson filter.
void ToJson(const Value& v, int indent, int level, std::string* o, int line) {
  const auto nl = [&](int l) {
    if (indent >= 0) {
      *o += '\n';
      o->append(static_cast<size_t>(indent) * l, ' ');
    }
  };
  switch (v.k) {
    case Value::K::kNone: *o += "null"; return;
    case Value::K::kBool: *o += v.b ? "true" : "false"; return;
    case Value::K::kInt: *o += std::to_string(v.i); return;
    case Value::K::kFloat:
      *o += std::isnan(v.f) ? "NaN" : std::isinf(v.f) ? (v.f < 0 ? "-Infinity" : "Infinity")
                                                       : PyFloat(v.f);
      return;
    case Value::K::kString:
      *o += '"';
      for (unsigned char c : v.s) {
        switch (c) {
          case '"': *o += "\\\""; break;
          case '\\': *o += "\\\\"; break;
          case '\n': *o += "\\n"; break;
          case '\r': *o += "\\r"; break;
          case '\t': *o += "\\t"; break;
          case '\b': *o += "\\b"; break;
          case '\f': *o += "\\f"; break;
          default:
            if (c < 0x20) {
              char b[8];
              std::snprintf(b, sizeof(b), "\\u%04x", c);
              *o += b;
            } else {
              *o += static_cast<char>(c);
            }
        }
      }
      *o += '"';
      return;
    case Value::K::kList: {
      if (v.list->empty()) {
        *o += "[]";
        return;
      }
      *o += '[';
      for (size_t k = 0; k < v.list->size(); ++k) {
        if (k) *o += indent >= 0 ? "," : ", ";
        nl(level + 1);
        ToJson((*v.list)[k], indent, level + 1, o, line);
      }
      nl(level);
      *o += ']';
      return;
    }
    case Value::K::kDict: {
      if (v.dict->ns) Fail(line, "tojson: object of type Namespace is not JSON serializable");
      if (v.dict->items.empty()) {
        *o += "{}";
        return;
      }
      *o += '{';
      bool first = true;
      for (const auto& [k, x] : v.dict->items) {
        if (!first) *o += indent >= 0 ? "," : ", ";
        first = false;
        nl(level + 1);
        ToJson(Value::Str(k), indent, level + 1, o, line);
        *o += ": ";
        ToJson(x, indent, level + 1, o, line);
      }
      nl(level);
      *o += '}';
      return;
    }
    default: Fail(line, absl::StrCat("tojson: object of type ", TypeName(v),
                                     " is not JSON serializable"));
  }
}

bool Equal(const Value& a, const Value& b) {
  if (a.numeric() && b.numeric()) {
    if (a.k == Value::K::kFloat || b.k == Value::K::kFloat) return a.num() == b.num();
    return a.integer() == b.integer();
  }
  if (a.k != b.k) return false;
  switch (a.k) {
    case Value::K::kUndefined:
    case Value::K::kNone: return true;
    case Value::K::kString: return a.s == b.s;
    case Value::K::kList:
      if (a.tuple != b.tuple || a.list->size() != b.list->size()) return false;
      for (size_t k = 0; k < a.list->size(); ++k) {
        if (!Equal((*a.list)[k], (*b.list)[k])) return false;
      }
      return true;
    case Value::K::kDict:
      if (a.dict->ns || b.dict->ns) return a.dict == b.dict;
      if (a.dict->items.size() != b.dict->items.size()) return false;
      for (const auto& [k, x] : a.dict->items) {
        const Value* y = b.dict->Find(k);
        if (y == nullptr || !Equal(x, *y)) return false;
      }
      return true;
    case Value::K::kFunc: return a.fn == b.fn;
    default: return false;
  }
}

// Python's a < b; mixed types are an error as in Python 3.
bool Less(const Value& a, const Value& b, int line) {
  if (a.numeric() && b.numeric()) {
    if (a.k == Value::K::kFloat || b.k == Value::K::kFloat) return a.num() < b.num();
    return a.integer() < b.integer();
  }
  if (a.is_str() && b.is_str()) return a.s < b.s;  // UTF-8 byte order is code point order
  if (a.k == Value::K::kList && b.k == Value::K::kList && a.tuple == b.tuple) {
    for (size_t k = 0; k < std::min(a.list->size(), b.list->size()); ++k) {
      if (!Equal((*a.list)[k], (*b.list)[k])) return Less((*a.list)[k], (*b.list)[k], line);
    }
    return a.list->size() < b.list->size();
  }
  if (a.undefined()) FailUndefined(a, line);
  if (b.undefined()) FailUndefined(b, line);
  Fail(line, absl::StrCat("'<' not supported between instances of '", TypeName(a), "' and '",
                          TypeName(b), "'"));
}

// ---------------------------------------------------------------------------------------------
// Lexer: the template text becomes text pieces and the tokens inside {{ }} and {% %}, with
// whitespace control applied as jinja2 does with trim_blocks and lstrip_blocks on.

struct Tok {
  enum T { kText, kVarBegin, kVarEnd, kBlockBegin, kBlockEnd, kName, kString, kInt, kFloat, kOp,
           kEof } t;
  std::string s;
  int64_t i = 0;
  double f = 0;
  int line = 0;
};

bool IsWs(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

void AppendUtf8(uint32_t cp, std::string* o) {
  if (cp < 0x80) {
    *o += static_cast<char>(cp);
  } else if (cp < 0x800) {
    *o += static_cast<char>(0xC0 | (cp >> 6));
    *o += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    *o += static_cast<char>(0xE0 | (cp >> 12));
    *o += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    *o += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    *o += static_cast<char>(0xF0 | (cp >> 18));
    *o += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    *o += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    *o += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

class Lexer {
 public:
  explicit Lexer(std::string src) : src_(std::move(src)) {}

  std::vector<Tok> Run() {
    // As jinja2: newlines normalized to \n, and one trailing newline dropped.
    std::string n;
    for (size_t k = 0; k < src_.size(); ++k) {
      if (src_[k] == '\r') {
        n += '\n';
        if (k + 1 < src_.size() && src_[k + 1] == '\n') ++k;
      } else {
        n += src_[k];
      }
    }
    if (!n.empty() && n.back() == '\n') n.pop_back();
    src_ = std::move(n);
    bool line_start = true;  // the text that follows starts a line (lstrip_blocks)
    while (pos_ < src_.size()) {
      size_t open = pos_;
      while (open + 1 < src_.size() &&
             !(src_[open] == '{' && (src_[open + 1] == '{' || src_[open + 1] == '%' ||
                                     src_[open + 1] == '#'))) {
        ++open;
      }
      if (open + 1 >= src_.size()) open = src_.size();
      std::string text = src_.substr(pos_, open - pos_);
      const int text_line = line_;
      for (char c : text) line_ += c == '\n';
      if (open < src_.size()) {
        const char kind = src_[open + 1];
        const char mark = open + 2 < src_.size() ? src_[open + 2] : 0;
        if (mark == '-') {
          while (!text.empty() && IsWs(text.back())) text.pop_back();
        } else if (mark != '+' && kind != '{') {
          // lstrip_blocks: whitespace between a line start and a block or comment tag.
          const size_t l = text.rfind('\n') == std::string::npos ? 0 : text.rfind('\n') + 1;
          if ((l > 0 || line_start) && l < text.size() &&
              std::all_of(text.begin() + l, text.end(), [](char c) { return IsWs(c); })) {
            text.resize(l);
          }
        }
      }
      if (!text.empty()) out_.push_back({Tok::kText, std::move(text), 0, 0, text_line});
      if (open >= src_.size()) break;
      pos_ = open + 2;
      const char kind = src_[open + 1];
      if (pos_ < src_.size() && (src_[pos_] == '-' || src_[pos_] == '+')) ++pos_;
      char end_mark = 0;
      if (kind == '#') {
        const size_t end = src_.find("#}", pos_);
        if (end == std::string::npos) Fail(line_, "unclosed comment");
        if (end > pos_ && (src_[end - 1] == '-' || src_[end - 1] == '+')) end_mark = src_[end - 1];
        for (size_t k = pos_; k < end; ++k) line_ += src_[k] == '\n';
        pos_ = end + 2;
      } else {
        end_mark = LexTag(kind == '%');
      }
      line_start = false;
      if (end_mark == '-') {
        while (pos_ < src_.size() && IsWs(src_[pos_])) {
          line_start = src_[pos_] == '\n';
          line_ += src_[pos_] == '\n';
          ++pos_;
        }
      } else if (kind != '{' && end_mark != '+' && pos_ < src_.size() && src_[pos_] == '\n') {
        ++pos_;  // trim_blocks
        ++line_;
        line_start = true;
      }
    }
    out_.push_back({Tok::kEof, "", 0, 0, line_});
    return std::move(out_);
  }

 private:
  // Tokens up to the closing %} or }} (outside brackets); returns '-' for -%} / -}}, '+' for
  // +%} (no trim_blocks), else 0.
  char LexTag(bool block) {
    out_.push_back({block ? Tok::kBlockBegin : Tok::kVarBegin, "", 0, 0, line_});
    int depth = 0;
    const char close = block ? '%' : '}';
    for (;;) {
      while (pos_ < src_.size() && IsWs(src_[pos_])) line_ += src_[pos_++] == '\n';
      if (pos_ >= src_.size()) Fail(line_, block ? "unclosed '{%'" : "unclosed '{{'");
      const std::string_view rest(src_.data() + pos_, src_.size() - pos_);
      if (depth == 0) {
        const std::string end = std::string(1, close) + "}";
        const bool minus = rest.substr(0, 3) == "-" + end;
        const bool plus = block && rest.substr(0, 3) == "+" + end;
        if (minus || plus || rest.substr(0, 2) == end) {
          pos_ += (minus || plus) ? 3 : 2;
          out_.push_back({block ? Tok::kBlockEnd : Tok::kVarEnd, "", 0, 0, line_});
          return minus ? '-' : plus ? '+' : 0;
        }
      }
      const char c = src_[pos_];
      if (c == '\'' || c == '"') {
        out_.push_back({Tok::kString, LexString(c), 0, 0, line_});
      } else if (std::isdigit(static_cast<unsigned char>(c))) {
        LexNumber();
      } else if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
        size_t e = pos_;
        while (e < src_.size() && (std::isalnum(static_cast<unsigned char>(src_[e])) || src_[e] == '_')) ++e;
        out_.push_back({Tok::kName, src_.substr(pos_, e - pos_), 0, 0, line_});
        pos_ = e;
      } else {
        static const char* kOps[] = {"**", "//", "==", "!=", "<=", ">=", "+", "-", "*", "/",
                                     "%", "~", "<", ">", "=", "(", ")", "[", "]", "{", "}",
                                     ",", ".", ":", "|"};
        std::string op;
        for (const char* o : kOps) {
          if (rest.substr(0, std::strlen(o)) == o) {
            op = o;
            break;
          }
        }
        if (op.empty()) Fail(line_, absl::StrCat("unexpected character '", std::string(1, c), "'"));
        if (op == "(" || op == "[" || op == "{") ++depth;
        if ((op == ")" || op == "]" || op == "}") && depth > 0) --depth;
        out_.push_back({Tok::kOp, op, 0, 0, line_});
        pos_ += op.size();
      }
    }
  }

  // A quoted string with Python's escapes; unknown escapes keep their backslash.
  std::string LexString(char q) {
    std::string v;
    size_t p = pos_ + 1;
    for (;;) {
      if (p >= src_.size()) Fail(line_, "unterminated string");
      const char c = src_[p];
      if (c == q) break;
      if (c == '\n') ++line_;
      if (c != '\\' || p + 1 >= src_.size()) {
        v += c;
        ++p;
        continue;
      }
      const char e = src_[p + 1];
      p += 2;
      const auto hex = [&](int n) -> uint32_t {
        if (p + n > src_.size()) Fail(line_, "truncated escape in string");
        uint32_t x = 0;
        for (int k = 0; k < n; ++k) {
          const char h = src_[p + k];
          if (!std::isxdigit(static_cast<unsigned char>(h))) Fail(line_, "bad escape in string");
          x = x * 16 + (std::isdigit(static_cast<unsigned char>(h)) ? h - '0' : (std::tolower(h) - 'a' + 10));
        }
        p += n;
        return x;
      };
      switch (e) {
        case 'n': v += '\n'; break;
        case 't': v += '\t'; break;
        case 'r': v += '\r'; break;
        case '0': v += '\0'; break;
        case 'a': v += '\a'; break;
        case 'b': v += '\b'; break;
        case 'f': v += '\f'; break;
        case 'v': v += '\v'; break;
        case '\\': v += '\\'; break;
        case '\'': v += '\''; break;
        case '"': v += '"'; break;
        case '\n': ++line_; break;  // a backslash-newline continues the line
        case 'x': AppendUtf8(hex(2), &v); break;
        case 'u': AppendUtf8(hex(4), &v); break;
        case 'U': AppendUtf8(hex(8), &v); break;
        default: v += '\\'; v += e;
      }
    }
    pos_ = p + 1;
    return v;
  }

  void LexNumber() {
    size_t e = pos_;
    bool is_float = false;
    const auto digits = [&] {
      while (e < src_.size() && (std::isdigit(static_cast<unsigned char>(src_[e])) || src_[e] == '_')) ++e;
    };
    digits();
    if (e + 1 < src_.size() && src_[e] == '.' && std::isdigit(static_cast<unsigned char>(src_[e + 1]))) {
      is_float = true;
      ++e;
      digits();
    }
    if (e < src_.size() && (src_[e] == 'e' || src_[e] == 'E')) {
      size_t x = e + 1;
      if (x < src_.size() && (src_[x] == '+' || src_[x] == '-')) ++x;
      if (x < src_.size() && std::isdigit(static_cast<unsigned char>(src_[x]))) {
        is_float = true;
        e = x;
        digits();
      }
    }
    std::string text = src_.substr(pos_, e - pos_);
    text.erase(std::remove(text.begin(), text.end(), '_'), text.end());
    Tok t{is_float ? Tok::kFloat : Tok::kInt, text, 0, 0, line_};
    if (is_float) {
      t.f = std::strtod(text.c_str(), nullptr);
    } else {
      auto r = std::from_chars(text.data(), text.data() + text.size(), t.i);
      if (r.ec != std::errc()) Fail(line_, "integer literal out of range");
    }
    out_.push_back(std::move(t));
    pos_ = e;
  }

  std::string src_;
  size_t pos_ = 0;
  int line_ = 1;
  std::vector<Tok> out_;
};

// ---------------------------------------------------------------------------------------------
// Syntax tree.

struct Expr;
using ExprP = std::unique_ptr<Expr>;

struct Expr {
  enum K { kLit, kName, kAttr, kItem, kSlice, kCall, kFilter, kTest, kNeg, kPos, kNot, kBin,
           kAnd, kOr, kCompare, kConcat, kCond, kList, kDict } k;
  int line = 0;
  int depth = 1;  // height of this subtree: bounds the evaluator's recursion
  Value lit;
  std::string name;                 // kName/kAttr: the name; kFilter/kTest: which; kBin: op
  bool negate = false;              // kTest: "is not"
  bool tuple = false;               // kList: a tuple literal
  std::vector<ExprP> kids;          // operands; kCall/kFilter/kTest: [subject, args..., kwargs...]
  std::vector<std::string> kw;      // names of the trailing keyword arguments in kids
  std::vector<std::string> ops;     // kCompare: the operators between kids
};

struct Node;
using NodeP = std::unique_ptr<Node>;
using Body = std::vector<NodeP>;

struct Node {
  enum K { kText, kOutput, kIf, kFor, kSet, kSetBlock, kBreak, kContinue, kScope, kMacro } k;
  int line = 0;
  std::string text;                  // kText
  ExprP expr;                        // kOutput, kSet value, kFor iterable
  std::vector<ExprP> conds;          // kIf: one per branch (null: else); kMacro: defaults
  std::vector<Body> bodies;          // kIf: branches; kFor: {body, else}; kSetBlock/kScope: {body}
  std::vector<std::string> targets;  // kFor / kSet names (several: unpacking); kMacro: name,
                                     // then its parameters
  std::string attr;                  // kSet: "ns.attr" assignment when non-empty
  ExprP filter;                      // kFor: "for x in y if cond"
};

using FilterFn = std::function<Value(const Value&, const CallArgs&)>;
using TestFn = std::function<bool(const Value&, const CallArgs&)>;
const std::unordered_map<std::string, FilterFn>& Filters();
const std::unordered_map<std::string, TestFn>& Tests();

class Parser {
 public:
  Parser(std::vector<Tok> toks, int max_depth) : t_(std::move(toks)), max_depth_(max_depth) {}

  Body ParseTemplate() {
    std::string end;
    Body b = ParseBody({}, &end);
    return b;
  }

 private:
  const Tok& Cur() const { return t_[p_]; }
  const Tok& Peek(size_t k = 1) const { return t_[std::min(p_ + k, t_.size() - 1)]; }
  bool IsOp(const char* op) const { return Cur().t == Tok::kOp && Cur().s == op; }
  bool IsName(const char* n) const { return Cur().t == Tok::kName && Cur().s == n; }
  bool SkipOp(const char* op) {
    if (!IsOp(op)) return false;
    ++p_;
    return true;
  }
  bool SkipName(const char* n) {
    if (!IsName(n)) return false;
    ++p_;
    return true;
  }
  std::string Describe(const Tok& t) const {
    switch (t.t) {
      case Tok::kEof: return "end of template";
      case Tok::kBlockEnd: return "'%}'";
      case Tok::kVarEnd: return "'}}'";
      case Tok::kText: return "text";
      default: return "'" + t.s + "'";
    }
  }
  void ExpectOp(const char* op) {
    if (!SkipOp(op)) Fail(Cur().line, absl::StrCat("expected '", op, "', got ", Describe(Cur())));
  }
  std::string ExpectName() {
    if (Cur().t != Tok::kName) Fail(Cur().line, "expected a name, got " + Describe(Cur()));
    return t_[p_++].s;
  }
  void ExpectBlockEnd() {
    if (Cur().t != Tok::kBlockEnd) Fail(Cur().line, "expected '%}', got " + Describe(Cur()));
    ++p_;
  }

  ExprP Make(Expr::K k, int line, std::vector<ExprP> kids = {}) {
    auto e = std::make_unique<Expr>();
    e->k = k;
    e->line = line;
    for (const ExprP& c : kids) {
      if (c) e->depth = std::max(e->depth, c->depth + 1);
    }
    e->kids = std::move(kids);
    if (e->depth > max_depth_) {
      Fail(line, absl::StrCat("expression nested deeper than ", max_depth_, " levels"));
    }
    return e;
  }
  void Redepth(Expr* e) {
    for (const ExprP& c : e->kids) {
      if (c) e->depth = std::max(e->depth, c->depth + 1);
    }
    if (e->depth > max_depth_) {
      Fail(e->line, absl::StrCat("expression nested deeper than ", max_depth_, " levels"));
    }
  }

  // The body up to a block tag named in `ends` (stored in *end, the tag's name consumed).
  Body ParseBody(const std::vector<std::string>& ends, std::string* end) {
    if (++block_depth_ > max_depth_) {
      Fail(Cur().line, absl::StrCat("blocks nested deeper than ", max_depth_, " levels"));
    }
    Body body;
    for (;;) {
      const Tok& t = Cur();
      if (t.t == Tok::kEof) {
        if (!ends.empty()) Fail(t.line, absl::StrCat("missing '{% ", ends.back(), " %}'"));
        break;
      }
      if (t.t == Tok::kText) {
        auto n = std::make_unique<Node>();
        n->k = Node::kText;
        n->line = t.line;
        n->text = t.s;
        body.push_back(std::move(n));
        ++p_;
        continue;
      }
      if (t.t == Tok::kVarBegin) {
        ++p_;
        auto n = std::make_unique<Node>();
        n->k = Node::kOutput;
        n->line = t.line;
        n->expr = ParseExpression();
        if (Cur().t != Tok::kVarEnd) Fail(Cur().line, "expected '}}', got " + Describe(Cur()));
        ++p_;
        body.push_back(std::move(n));
        continue;
      }
      // A block tag.
      ++p_;
      const int line = Cur().line;
      const std::string tag = ExpectName();
      if (std::find(ends.begin(), ends.end(), tag) != ends.end()) {
        *end = tag;
        --block_depth_;
        return body;
      }
      body.push_back(ParseStatement(tag, line));
    }
    --block_depth_;
    return body;
  }

  NodeP ParseStatement(const std::string& tag, int line) {
    auto n = std::make_unique<Node>();
    n->line = line;
    std::string end;
    if (tag == "if") {
      n->k = Node::kIf;
      n->conds.push_back(ParseExpression());
      ExpectBlockEnd();
      for (;;) {
        n->bodies.push_back(ParseBody({"elif", "else", "endif"}, &end));
        if (end == "endif") break;
        if (end == "elif") {
          n->conds.push_back(ParseExpression());
        } else {
          n->conds.push_back(nullptr);
          ExpectBlockEnd();
          n->bodies.push_back(ParseBody({"endif"}, &end));
          break;
        }
        ExpectBlockEnd();
      }
      ExpectBlockEnd();
    } else if (tag == "for") {
      n->k = Node::kFor;
      do {
        n->targets.push_back(ExpectName());
      } while (SkipOp(","));
      if (!SkipName("in")) Fail(Cur().line, "expected 'in' in a for loop");
      n->expr = ParseOr();  // no conditional expression here: "if" filters the loop
      if (SkipName("if")) n->filter = ParseExpression();
      if (IsName("recursive")) Fail(line, "recursive loops are not supported");
      ExpectBlockEnd();
      n->bodies.push_back(ParseBody({"else", "endfor"}, &end));
      if (end == "else") {
        ExpectBlockEnd();
        n->bodies.push_back(ParseBody({"endfor"}, &end));
      }
      ExpectBlockEnd();
    } else if (tag == "set") {
      n->targets.push_back(ExpectName());
      if (SkipOp(".")) {
        n->attr = ExpectName();
      } else {
        while (SkipOp(",")) n->targets.push_back(ExpectName());
      }
      if (SkipOp("=")) {
        n->k = Node::kSet;
        n->expr = ParseExpression();
        if (IsOp(",")) {  // set a = x, y: a tuple
          auto lst = Make(Expr::kList, line);
          lst->tuple = true;
          lst->kids.push_back(std::move(n->expr));
          while (SkipOp(",")) lst->kids.push_back(ParseExpression());
          Redepth(lst.get());
          n->expr = std::move(lst);
        }
        ExpectBlockEnd();
      } else {
        if (!n->attr.empty() || n->targets.size() != 1) Fail(line, "a block set takes one name");
        n->k = Node::kSetBlock;
        ExpectBlockEnd();
        n->bodies.push_back(ParseBody({"endset"}, &end));
        ExpectBlockEnd();
      }
    } else if (tag == "break" || tag == "continue") {
      n->k = tag == "break" ? Node::kBreak : Node::kContinue;
      ExpectBlockEnd();
    } else if (tag == "macro") {
      // {% macro name(a, b=default) %}...{% endmacro %}: no caller(), varargs or kwargs.
      n->k = Node::kMacro;
      n->targets.push_back(ExpectName());
      ExpectOp("(");
      while (!IsOp(")")) {
        n->targets.push_back(ExpectName());
        n->conds.push_back(SkipOp("=") ? ParseExpression() : nullptr);
        if (!SkipOp(",")) break;
      }
      ExpectOp(")");
      ExpectBlockEnd();
      n->bodies.push_back(ParseBody({"endmacro"}, &end));
      ExpectBlockEnd();
    } else if (tag == "generation") {
      // transformers' AssistantTracker tag: marks assistant text; renders its body unchanged.
      n->k = Node::kScope;
      ExpectBlockEnd();
      n->bodies.push_back(ParseBody({"endgeneration"}, &end));
      ExpectBlockEnd();
    } else {
      Fail(line, absl::StrCat("unsupported template tag '", tag, "'"));
    }
    return n;
  }

  // Expressions, in jinja2's precedence order.
  ExprP ParseExpression() {
    ExprP e = ParseOr();
    while (IsName("if")) {
      const int line = Cur().line;
      ++p_;
      ExprP cond = ParseOr();
      ExprP other;
      if (SkipName("else")) other = ParseExpression();
      std::vector<ExprP> kids;
      kids.push_back(std::move(cond));
      kids.push_back(std::move(e));
      kids.push_back(std::move(other));
      e = Make(Expr::kCond, line, std::move(kids));
    }
    return e;
  }
  ExprP Binary(Expr::K k, ExprP a, ExprP b, int line, std::string op = "") {
    std::vector<ExprP> kids;
    kids.push_back(std::move(a));
    kids.push_back(std::move(b));
    ExprP e = Make(k, line, std::move(kids));
    e->name = std::move(op);
    return e;
  }
  ExprP ParseOr() {
    ExprP e = ParseAnd();
    while (IsName("or")) {
      const int line = Cur().line;
      ++p_;
      e = Binary(Expr::kOr, std::move(e), ParseAnd(), line);
    }
    return e;
  }
  ExprP ParseAnd() {
    ExprP e = ParseNot();
    while (IsName("and")) {
      const int line = Cur().line;
      ++p_;
      e = Binary(Expr::kAnd, std::move(e), ParseNot(), line);
    }
    return e;
  }
  ExprP ParseNot() {
    if (IsName("not")) {
      const int line = Cur().line;
      ++p_;
      Guard g(this);
      std::vector<ExprP> kids;
      kids.push_back(ParseNot());
      return Make(Expr::kNot, line, std::move(kids));
    }
    return ParseCompare();
  }
  ExprP ParseCompare() {
    const int line = Cur().line;
    ExprP first = ParseMath1();
    std::vector<ExprP> kids;
    std::vector<std::string> ops;
    for (;;) {
      if (Cur().t == Tok::kOp && (Cur().s == "==" || Cur().s == "!=" || Cur().s == "<" ||
                                  Cur().s == ">" || Cur().s == "<=" || Cur().s == ">=")) {
        ops.push_back(t_[p_++].s);
      } else if (IsName("in")) {
        ++p_;
        ops.push_back("in");
      } else if (IsName("not") && Peek().t == Tok::kName && Peek().s == "in") {
        p_ += 2;
        ops.push_back("notin");
      } else {
        break;
      }
      kids.push_back(ParseMath1());
    }
    if (ops.empty()) return first;
    kids.insert(kids.begin(), std::move(first));
    ExprP e = Make(Expr::kCompare, line, std::move(kids));
    e->ops = std::move(ops);
    return e;
  }
  ExprP ParseMath1() {
    ExprP e = ParseConcat();
    while (IsOp("+") || IsOp("-")) {
      const Tok& t = t_[p_++];
      e = Binary(Expr::kBin, std::move(e), ParseConcat(), t.line, t.s);
    }
    return e;
  }
  ExprP ParseConcat() {
    const int line = Cur().line;
    std::vector<ExprP> parts;
    parts.push_back(ParseMath2());
    while (SkipOp("~")) parts.push_back(ParseMath2());
    if (parts.size() == 1) return std::move(parts[0]);
    return Make(Expr::kConcat, line, std::move(parts));
  }
  ExprP ParseMath2() {
    ExprP e = ParsePow();
    while (IsOp("*") || IsOp("/") || IsOp("//") || IsOp("%")) {
      const Tok& t = t_[p_++];
      e = Binary(Expr::kBin, std::move(e), ParsePow(), t.line, t.s);
    }
    return e;
  }
  ExprP ParsePow() {
    ExprP e = ParseUnary(true);
    while (IsOp("**")) {
      const Tok& t = t_[p_++];
      e = Binary(Expr::kBin, std::move(e), ParseUnary(true), t.line, t.s);
    }
    return e;
  }

  // Recursion guard for the parser itself (parentheses, unary chains, nested literals).
  struct Guard {
    explicit Guard(Parser* p) : p(p) {
      if (++p->expr_depth_ > p->max_depth_) {
        Fail(p->Cur().line, absl::StrCat("expression nested deeper than ", p->max_depth_,
                                         " levels"));
      }
    }
    ~Guard() { --p->expr_depth_; }
    Parser* p;
  };

  ExprP ParseUnary(bool with_filter) {
    Guard g(this);
    const int line = Cur().line;
    ExprP e;
    if (IsOp("-") || IsOp("+")) {
      const bool neg = Cur().s == "-";
      ++p_;
      std::vector<ExprP> kids;
      kids.push_back(ParseUnary(false));
      e = Make(neg ? Expr::kNeg : Expr::kPos, line, std::move(kids));
    } else {
      e = ParsePrimary();
    }
    e = ParsePostfix(std::move(e));
    if (with_filter) e = ParseFilterExpr(std::move(e));
    return e;
  }

  ExprP ParsePrimary() {
    Guard g(this);
    const Tok& t = Cur();
    const int line = t.line;
    if (t.t == Tok::kName) {
      ++p_;
      ExprP e = Make(Expr::kLit, line);
      if (t.s == "true" || t.s == "True") {
        e->lit = Value::Bool(true);
      } else if (t.s == "false" || t.s == "False") {
        e->lit = Value::Bool(false);
      } else if (t.s == "none" || t.s == "None") {
        e->lit = Value::None();
      } else {
        e->k = Expr::kName;
        e->name = t.s;
      }
      return e;
    }
    if (t.t == Tok::kString) {
      std::string s;
      while (Cur().t == Tok::kString) s += t_[p_++].s;  // adjacent literals concatenate
      ExprP e = Make(Expr::kLit, line);
      e->lit = Value::Str(std::move(s));
      return e;
    }
    if (t.t == Tok::kInt || t.t == Tok::kFloat) {
      ++p_;
      ExprP e = Make(Expr::kLit, line);
      e->lit = t.t == Tok::kInt ? Value::Int(t.i) : Value::Float(t.f);
      return e;
    }
    if (SkipOp("(")) {
      if (SkipOp(")")) {  // ()
        ExprP e = Make(Expr::kList, line);
        e->tuple = true;
        return e;
      }
      ExprP e = ParseExpression();
      if (IsOp(",")) {  // a tuple: a list here
        std::vector<ExprP> items;
        items.push_back(std::move(e));
        while (SkipOp(",")) {
          if (IsOp(")")) break;
          items.push_back(ParseExpression());
        }
        e = Make(Expr::kList, line, std::move(items));
        e->tuple = true;
      }
      ExpectOp(")");
      return e;
    }
    if (SkipOp("[")) {
      std::vector<ExprP> items;
      while (!IsOp("]")) {
        items.push_back(ParseExpression());
        if (!SkipOp(",")) break;
      }
      ExpectOp("]");
      return Make(Expr::kList, line, std::move(items));
    }
    if (SkipOp("{")) {
      std::vector<ExprP> items;  // key, value, key, value...
      while (!IsOp("}")) {
        items.push_back(ParseExpression());
        ExpectOp(":");
        items.push_back(ParseExpression());
        if (!SkipOp(",")) break;
      }
      ExpectOp("}");
      return Make(Expr::kDict, line, std::move(items));
    }
    Fail(line, "unexpected " + Describe(t));
  }

  ExprP ParsePostfix(ExprP e) {
    for (;;) {
      const int line = Cur().line;
      if (SkipOp(".")) {
        if (Cur().t == Tok::kInt) {
          ExprP idx = Make(Expr::kLit, line);
          idx->lit = Value::Int(t_[p_++].i);
          e = Binary(Expr::kItem, std::move(e), std::move(idx), line);
        } else {
          std::vector<ExprP> kids;
          kids.push_back(std::move(e));
          e = Make(Expr::kAttr, line, std::move(kids));
          e->name = ExpectName();
        }
      } else if (SkipOp("[")) {
        e = ParseSubscript(std::move(e), line);
      } else if (IsOp("(")) {
        e = ParseCall(std::move(e), Expr::kCall, "");
      } else {
        return e;
      }
    }
  }

  ExprP ParseSubscript(ExprP obj, int line) {
    std::vector<ExprP> parts(3);
    bool slice = false;
    for (int k = 0; k < 3; ++k) {
      if (!IsOp(":") && !IsOp("]")) parts[k] = ParseExpression();
      if (k < 2 && SkipOp(":")) {
        slice = true;
      } else {
        break;
      }
    }
    ExpectOp("]");
    if (!slice) {
      if (!parts[0]) Fail(line, "empty subscript");
      return Binary(Expr::kItem, std::move(obj), std::move(parts[0]), line);
    }
    std::vector<ExprP> kids;
    kids.push_back(std::move(obj));
    for (auto& p : parts) kids.push_back(std::move(p));
    return Make(Expr::kSlice, line, std::move(kids));
  }

  // Call arguments after the subject (kids[0]): positional, then name=value.
  ExprP ParseCall(ExprP subject, Expr::K k, std::string name) {
    const int line = Cur().line;
    std::vector<ExprP> kids;
    kids.push_back(std::move(subject));
    std::vector<std::string> kw;
    if (SkipOp("(")) {
      while (!IsOp(")")) {
        if (Cur().t == Tok::kName && Peek().t == Tok::kOp && Peek().s == "=") {
          kw.push_back(t_[p_].s);
          p_ += 2;
          kids.push_back(ParseExpression());
        } else {
          if (!kw.empty()) Fail(Cur().line, "positional argument after keyword argument");
          kids.push_back(ParseExpression());
        }
        if (!SkipOp(",")) break;
      }
      ExpectOp(")");
    }
    ExprP e = Make(k, line, std::move(kids));
    e->kw = std::move(kw);
    e->name = std::move(name);
    return e;
  }

  ExprP ParseFilterExpr(ExprP e) {
    for (;;) {
      if (SkipOp("|")) {
        const int line = Cur().line;
        std::string name = ExpectName();
        while (SkipOp(".")) name += "." + ExpectName();
        if (!Filters().count(name)) Fail(line, absl::StrCat("unknown filter '", name, "'"));
        e = ParseCall(std::move(e), Expr::kFilter, name);
      } else if (IsName("is")) {
        const int line = Cur().line;
        ++p_;
        const bool negate = SkipName("not");
        std::string name = ExpectName();
        if (!Tests().count(name)) Fail(line, absl::StrCat("unknown test '", name, "'"));
        if (IsOp("(")) {
          e = ParseCall(std::move(e), Expr::kTest, name);
        } else {
          std::vector<ExprP> kids;
          kids.push_back(std::move(e));
          const Tok& c = Cur();
          const bool arg = (c.t == Tok::kName || c.t == Tok::kString || c.t == Tok::kInt ||
                            c.t == Tok::kFloat || (c.t == Tok::kOp && (c.s == "[" || c.s == "{"))) &&
                           !(c.t == Tok::kName && (c.s == "else" || c.s == "or" || c.s == "and"));
          if (arg) {
            if (IsName("is")) Fail(c.line, "tests cannot be chained with 'is'");
            kids.push_back(ParsePostfix(ParsePrimary()));
          }
          e = Make(Expr::kTest, line, std::move(kids));
          e->name = name;
        }
        e->negate = negate;
      } else if (IsOp("(")) {
        e = ParseCall(std::move(e), Expr::kCall, "");
      } else {
        return e;
      }
    }
  }

  std::vector<Tok> t_;
  size_t p_ = 0;
  int max_depth_;
  int block_depth_ = 0;
  int expr_depth_ = 0;
};

// ---------------------------------------------------------------------------------------------
// Builtins: string / dict methods, filters, tests, globals.

int64_t ToIndex(const Value& v, int line, const char* what) {
  if (v.k != Value::K::kInt && v.k != Value::K::kBool) {
    Fail(line, absl::StrCat(what, " must be an integer, not ", TypeName(v)));
  }
  return v.integer();
}

std::string StrArg(const std::optional<Value>& v, int line, const char* what) {
  if (!v || !v->is_str()) Fail(line, absl::StrCat(what, " must be a string"));
  return v->s;
}

std::optional<std::string> OptStr(const std::optional<Value>& v, int line, const char* what) {
  if (!v || v->k == Value::K::kNone) return std::nullopt;
  return StrArg(v, line, what);
}

void CheckSize(size_t n, size_t limit, int line) {
  if (n > limit) Fail(line, absl::StrCat("string of ", n, " bytes exceeds the output limit of ", limit));
}

// The items a for loop or a filter iterates: list items, dict keys, string characters.
ValueList Items(const Value& v, int line) {
  switch (v.k) {
    case Value::K::kUndefined: return {};
    case Value::K::kList: return *v.list;
    case Value::K::kDict: {
      ValueList out;
      for (const auto& [k, x] : v.dict->items) out.push_back(Value::Str(k));
      return out;
    }
    case Value::K::kString: {
      ValueList out;
      const auto o = CharOffsets(v.s);
      for (size_t k = 0; k + 1 < o.size(); ++k) out.push_back(Value::Str(v.s.substr(o[k], o[k + 1] - o[k])));
      return out;
    }
    default: Fail(line, absl::StrCat("'", TypeName(v), "' object is not iterable"));
  }
}

std::string Replace(const std::string& s, const std::string& from, const std::string& to,
                    int64_t count, size_t limit, int line) {
  std::string out;
  int64_t done = 0;
  if (from.empty()) {  // Python inserts `to` around every character
    const auto o = CharOffsets(s);
    for (size_t k = 0; k + 1 < o.size(); ++k) {
      if (count < 0 || done < count) {
        out += to;
        ++done;
      }
      out.append(s, o[k], o[k + 1] - o[k]);
      CheckSize(out.size(), limit, line);
    }
    if (count < 0 || done < count) out += to;
    return out;
  }
  size_t p = 0;
  while (count < 0 || done < count) {
    const size_t q = s.find(from, p);
    if (q == std::string::npos) break;
    out.append(s, p, q - p);
    out += to;
    CheckSize(out.size(), limit, line);
    p = q + from.size();
    ++done;
  }
  out.append(s, p);
  CheckSize(out.size(), limit, line);
  return out;
}

Value Split(const std::string& s, const std::optional<std::string>& sep, int64_t maxsplit,
            int line) {
  ValueList out;
  if (sep) {
    if (sep->empty()) Fail(line, "split: empty separator");
    size_t p = 0;
    for (int64_t n = 0; maxsplit < 0 || n < maxsplit; ++n) {
      const size_t q = s.find(*sep, p);
      if (q == std::string::npos) break;
      out.push_back(Value::Str(s.substr(p, q - p)));
      p = q + sep->size();
    }
    out.push_back(Value::Str(s.substr(p)));
    return Value::List(std::move(out));
  }
  // Runs of whitespace; leading and trailing whitespace yields no empty strings.
  const auto o = CharOffsets(s);
  size_t k = 0, n = 0;
  const auto space = [&](size_t idx) { return PySpace(DecodeAt(s, o[idx], &n)); };
  const size_t chars = o.size() - 1;
  while (k < chars) {
    while (k < chars && space(k)) ++k;
    if (k >= chars) break;
    if (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit) {
      size_t e = chars;
      while (e > k && space(e - 1)) --e;
      out.push_back(Value::Str(s.substr(o[k], o[e] - o[k])));
      break;
    }
    size_t b = k;
    while (k < chars && !space(k)) ++k;
    out.push_back(Value::Str(s.substr(o[b], o[k] - o[b])));
  }
  return Value::List(std::move(out));
}

// Python's title(): a cased letter after an uncased character is upper case, the rest lower.
std::string Title(const std::string& s) {
  std::string o;
  bool prev_cased = false;
  for (size_t p = 0, n = 0; p < s.size(); p += n) {
    const uint32_t c = DecodeAt(s, p, &n);
    if (n == 1 && c >= 0x80) {  // invalid UTF-8: unchanged
      o += s[p];
      prev_cased = false;
      continue;
    }
    const bool cased = CaseOf(c, true) != c || CaseOf(c, false) != c;
    AppendUtf8(cased ? CaseOf(c, !prev_cased) : c, &o);
    prev_cased = cased;
  }
  return o;
}

// Python's capitalize(): first character upper, the rest lower.
std::string Capitalize(const std::string& s) {
  if (s.empty()) return s;
  const size_t n = CharLen(static_cast<unsigned char>(s[0]));
  return CaseMap(s.substr(0, n), true) + CaseMap(s.substr(std::min(n, s.size())), false);
}

Value StrMethod(const std::string& self, const std::string& name, size_t limit) {
  auto fn = [self, name, limit](const CallArgs& a) -> Value {
    const int line = a.line;
    if (name == "strip" || name == "lstrip" || name == "rstrip") {
      return Value::Str(Strip(self, OptStr(a.Get(0, "chars"), line, "strip: chars"),
                              name != "rstrip", name != "lstrip"));
    }
    if (name == "upper") return Value::Str(CaseMap(self, true));
    if (name == "lower") return Value::Str(CaseMap(self, false));
    if (name == "title") return Value::Str(Title(self));
    if (name == "capitalize") return Value::Str(Capitalize(self));
    if (name == "startswith" || name == "endswith") {
      const std::optional<Value> x = a.Get(0, "prefix");
      ValueList options = x && x->k == Value::K::kList ? *x->list : ValueList{x.value_or(Value())};
      for (const Value& o : options) {
        if (!o.is_str()) Fail(line, name + ": argument must be a string or a list of strings");
        const bool hit = name == "startswith"
                             ? self.compare(0, o.s.size(), o.s) == 0 && self.size() >= o.s.size()
                             : self.size() >= o.s.size() &&
                                   self.compare(self.size() - o.s.size(), o.s.size(), o.s) == 0;
        if (hit) return Value::Bool(true);
      }
      return Value::Bool(false);
    }
    if (name == "split") {
      const std::optional<Value> m = a.Get(1, "maxsplit");
      return Split(self, OptStr(a.Get(0, "sep"), line, "split: sep"),
                   m ? ToIndex(*m, line, "split: maxsplit") : -1, line);
    }
    if (name == "replace") {
      const std::optional<Value> c = a.Get(2, "count");
      return Value::Str(Replace(self, StrArg(a.Get(0, "old"), line, "replace: old"),
                                StrArg(a.Get(1, "new"), line, "replace: new"),
                                c ? ToIndex(*c, line, "replace: count") : -1, limit, line));
    }
    if (name == "join") {
      std::string out;
      const ValueList items = Items(a.Get(0, "iterable").value_or(Value()), line);
      for (size_t k = 0; k < items.size(); ++k) {
        if (!items[k].is_str()) Fail(line, "join: sequence item is not a string");
        if (k) out += self;
        out += items[k].s;
        CheckSize(out.size(), limit, line);
      }
      return Value::Str(std::move(out));
    }
    if (name == "find") {
      const size_t p = self.find(StrArg(a.Get(0, "sub"), line, "find: sub"));
      if (p == std::string::npos) return Value::Int(-1);
      const auto o = CharOffsets(self);
      return Value::Int(std::lower_bound(o.begin(), o.end(), p) - o.begin());
    }
    if (name == "count") {
      const std::string sub = StrArg(a.Get(0, "sub"), line, "count: sub");
      if (sub.empty()) return Value::Int(static_cast<int64_t>(CharOffsets(self).size()));
      int64_t n = 0;
      for (size_t p = self.find(sub); p != std::string::npos; p = self.find(sub, p + sub.size())) ++n;
      return Value::Int(n);
    }
    if (name == "isdigit" || name == "isspace" || name == "isalpha" || name == "isalnum") {
      if (self.empty()) return Value::Bool(false);
      for (unsigned char c : self) {
        const bool ok = name == "isdigit"   ? std::isdigit(c)
                        : name == "isspace" ? IsWs(static_cast<char>(c))
                        : name == "isalpha" ? std::isalpha(c)
                                            : std::isalnum(c);
        if (!ok) return Value::Bool(false);
      }
      return Value::Bool(true);
    }
    Fail(line, "unreachable string method");
  };
  return MakeFunc("str." + name, std::move(fn));
}

bool IsStrMethod(const std::string& n) {
  static const char* kNames[] = {"strip", "lstrip", "rstrip", "upper", "lower", "title",
                                 "capitalize", "startswith", "endswith", "split",
                                 "replace", "join", "find", "count", "isdigit", "isspace",
                                 "isalpha", "isalnum"};
  return std::find(std::begin(kNames), std::end(kNames), n) != std::end(kNames);
}

bool IsDictMethod(const std::string& n) {
  return n == "items" || n == "keys" || n == "values" || n == "get";
}

Value DictMethod(const Value& self, const std::string& name) {
  auto fn = [self, name](const CallArgs& a) -> Value {
    ValueList out;
    if (name == "get") {
      const std::optional<Value> key = a.Get(0, "key");
      if (key && key->is_str()) {
        if (const Value* v = self.dict->Find(key->s)) return *v;
      }
      return a.Get(1, "default").value_or(Value::None());
    }
    for (const auto& [k, v] : self.dict->items) {
      if (name == "items") out.push_back(Value::Tuple({Value::Str(k), v}));
      if (name == "keys") out.push_back(Value::Str(k));
      if (name == "values") out.push_back(v);
    }
    return Value::List(std::move(out));
  };
  return MakeFunc("dict." + name, std::move(fn));
}

// obj.name: a method, else (dicts) the key, else undefined; undefined.name is an error.
Value GetAttr(const Value& obj, const std::string& name, size_t limit, int line) {
  switch (obj.k) {
    case Value::K::kUndefined: FailUndefined(obj, line);
    case Value::K::kDict:
      if (!obj.dict->ns && IsDictMethod(name)) return DictMethod(obj, name);
      if (const Value* v = obj.dict->Find(name)) return *v;
      return Value::Undefined(
          absl::StrCat("'", TypeName(obj), " object' has no attribute '", name, "'"));
    case Value::K::kString:
      if (IsStrMethod(name)) return StrMethod(obj.s, name, limit);
      break;
    default: break;
  }
  return Value::Undefined(
      absl::StrCat("'", TypeName(obj), " object' has no attribute '", name, "'"));
}

Value GetItem(const Value& obj, const Value& key, size_t limit, int line) {
  if (obj.undefined()) FailUndefined(obj, line);
  if (obj.k == Value::K::kDict) {
    if (key.is_str()) {
      if (const Value* v = obj.dict->Find(key.s)) return *v;
      return GetAttr(obj, key.s, limit, line);
    }
    return Value::Undefined("'dict object' has no key " + Repr(key));
  }
  if ((obj.k == Value::K::kList || obj.k == Value::K::kString) &&
      (key.k == Value::K::kInt || key.k == Value::K::kBool)) {
    std::vector<size_t> o;
    const int64_t n = obj.k == Value::K::kList ? static_cast<int64_t>(obj.list->size())
                                               : static_cast<int64_t>((o = CharOffsets(obj.s)).size() - 1);
    int64_t k = key.integer();
    if (k < 0) k += n;
    if (k < 0 || k >= n) return Value::Undefined(absl::StrCat(TypeName(obj), " index ", key.integer(), " out of range"));
    if (obj.k == Value::K::kList) return (*obj.list)[k];
    return Value::Str(obj.s.substr(o[k], o[k + 1] - o[k]));
  }
  if (key.is_str()) return GetAttr(obj, key.s, limit, line);
  return Value::Undefined(absl::StrCat("'", TypeName(obj), " object' has no item ", Repr(key)));
}

// Python slice semantics: obj[start:stop:step].
Value Slice(const Value& obj, const std::optional<int64_t>& start, const std::optional<int64_t>& stop,
            const std::optional<int64_t>& step_opt, int line) {
  if (obj.undefined()) FailUndefined(obj, line);
  const int64_t step = step_opt.value_or(1);
  if (step == 0) Fail(line, "slice step cannot be zero");
  std::vector<size_t> o;
  int64_t n = 0;
  if (obj.k == Value::K::kList) {
    n = static_cast<int64_t>(obj.list->size());
  } else if (obj.is_str()) {
    o = CharOffsets(obj.s);
    n = static_cast<int64_t>(o.size()) - 1;
  } else {
    Fail(line, absl::StrCat("'", TypeName(obj), "' object cannot be sliced"));
  }
  const auto clamp = [&](std::optional<int64_t> v, int64_t dflt) {
    if (!v) return dflt;
    int64_t x = *v;
    if (x < 0) x += n;
    if (step > 0) return std::clamp<int64_t>(x, 0, n);
    return std::clamp<int64_t>(x, -1, n - 1);
  };
  const int64_t a = clamp(start, step > 0 ? 0 : n - 1);
  const int64_t b = clamp(stop, step > 0 ? n : -1);
  std::vector<int64_t> idx;
  for (int64_t k = a; step > 0 ? k < b : k > b; k += step) idx.push_back(k);
  if (obj.k == Value::K::kList) {
    ValueList out;
    for (int64_t k : idx) out.push_back((*obj.list)[k]);
    return Value::List(std::move(out));
  }
  if (step == 1) return Value::Str(obj.s.substr(o[a], a < b ? o[b] - o[a] : 0));
  std::string out;
  for (int64_t k : idx) out.append(obj.s, o[k], o[k + 1] - o[k]);
  return Value::Str(std::move(out));
}

bool RunTest(const std::string& name, const Value& v, const CallArgs& a);

const std::unordered_map<std::string, TestFn>& Tests() {
  static const auto* kTests = [] {
    auto* m = new std::unordered_map<std::string, TestFn>;
    auto& t = *m;
    using K = Value::K;
    t["defined"] = [](const Value& v, const CallArgs&) { return !v.undefined(); };
    t["undefined"] = [](const Value& v, const CallArgs&) { return v.undefined(); };
    t["none"] = [](const Value& v, const CallArgs&) { return v.k == K::kNone; };
    t["boolean"] = [](const Value& v, const CallArgs&) { return v.k == K::kBool; };
    t["true"] = [](const Value& v, const CallArgs&) { return v.k == K::kBool && v.b; };
    t["false"] = [](const Value& v, const CallArgs&) { return v.k == K::kBool && !v.b; };
    t["integer"] = [](const Value& v, const CallArgs&) { return v.k == K::kInt; };
    t["float"] = [](const Value& v, const CallArgs&) { return v.k == K::kFloat; };
    t["number"] = [](const Value& v, const CallArgs&) { return v.numeric(); };
    t["string"] = [](const Value& v, const CallArgs&) { return v.is_str(); };
    t["mapping"] = [](const Value& v, const CallArgs&) { return v.k == K::kDict && !v.dict->ns; };
    t["sequence"] = [](const Value& v, const CallArgs&) {
      return v.is_str() || v.k == K::kList || (v.k == K::kDict && !v.dict->ns);
    };
    t["iterable"] = t["sequence"];
    t["callable"] = [](const Value& v, const CallArgs&) { return v.k == K::kFunc; };
    t["lower"] = [](const Value& v, const CallArgs&) {
      return v.is_str() && CaseMap(v.s, false) == v.s;
    };
    t["upper"] = [](const Value& v, const CallArgs&) {
      return v.is_str() && CaseMap(v.s, true) == v.s;
    };
    t["even"] = [](const Value& v, const CallArgs& a) {
      return ToIndex(v, a.line, "even: value") % 2 == 0;
    };
    t["odd"] = [](const Value& v, const CallArgs& a) {
      return ToIndex(v, a.line, "odd: value") % 2 != 0;
    };
    t["divisibleby"] = [](const Value& v, const CallArgs& a) {
      const int64_t d = ToIndex(a.Get(0, "num").value_or(Value()), a.line, "divisibleby: num");
      if (d == 0) Fail(a.line, "divisibleby 0");
      return ToIndex(v, a.line, "divisibleby: value") % d == 0;
    };
    const auto cmp = [](int which) {
      return [which](const Value& v, const CallArgs& a) {
        const Value o = a.Get(0, "other").value_or(Value());
        switch (which) {
          case 0: return Equal(v, o);
          case 1: return !Equal(v, o);
          case 2: return Less(v, o, a.line);
          case 3: return !Less(o, v, a.line);
          case 4: return Less(o, v, a.line);
          default: return !Less(v, o, a.line);
        }
      };
    };
    t["eq"] = t["equalto"] = t["=="] = cmp(0);
    t["ne"] = t["!="] = cmp(1);
    t["lt"] = t["lessthan"] = t["<"] = cmp(2);
    t["le"] = t["<="] = cmp(3);
    t["gt"] = t["greaterthan"] = t[">"] = cmp(4);
    t["ge"] = t[">="] = cmp(5);
    t["sameas"] = [](const Value& v, const CallArgs& a) {
      const Value o = a.Get(0, "other").value_or(Value());
      if (v.k != o.k) return false;
      if (v.k == K::kList) return v.list == o.list;
      if (v.k == K::kDict) return v.dict == o.dict;
      return Equal(v, o);
    };
    t["in"] = [](const Value& v, const CallArgs& a) {
      const Value seq = a.Get(0, "seq").value_or(Value());
      if (seq.is_str()) return v.is_str() && seq.s.find(v.s) != std::string::npos;
      if (seq.k == K::kDict) return v.is_str() && seq.dict->Find(v.s) != nullptr;
      for (const Value& x : Items(seq, a.line)) {
        if (Equal(x, v)) return true;
      }
      return false;
    };
    return m;
  }();
  return *kTests;
}

bool RunTest(const std::string& name, const Value& v, const CallArgs& a) {
  return Tests().at(name)(v, a);
}

// select / reject / selectattr / rejectattr.
Value SelectFilter(const Value& in, const CallArgs& a, bool attr, bool keep) {
  CallArgs rest;
  rest.line = a.line;
  size_t first = 0;
  std::string attribute;
  if (attr) {
    attribute = StrArg(a.Get(0, "attribute"), a.line, "selectattr: attribute");
    first = 1;
  }
  std::string test;
  if (first < a.pos.size()) {
    test = StrArg(a.pos[first], a.line, "select: test name");
    if (!Tests().count(test)) Fail(a.line, absl::StrCat("unknown test '", test, "'"));
    rest.pos.assign(a.pos.begin() + first + 1, a.pos.end());
  }
  ValueList out;
  for (const Value& x : Items(in, a.line)) {
    Value subject = x;
    if (attr) {
      subject = x.k == Value::K::kDict ? GetAttr(x, attribute, SIZE_MAX, a.line)
                                       : Value::Undefined("'" + attribute + "' is undefined");
    }
    const bool pass = test.empty() ? Truthy(subject) : RunTest(test, subject, rest);
    if (pass == keep) out.push_back(x);
  }
  return Value::List(std::move(out));
}

const std::unordered_map<std::string, FilterFn>& Filters() {
  static const auto* kFilters = [] {
    auto* m = new std::unordered_map<std::string, FilterFn>;
    auto& f = *m;
    using K = Value::K;
    const auto need_str = [](const Value& v, int line, const char* filter) -> std::string {
      if (v.undefined()) FailUndefined(v, line);
      return v.is_str() ? v.s : ToStr(v);
    };
    f["trim"] = [need_str](const Value& v, const CallArgs& a) {
      return Value::Str(Strip(need_str(v, a.line, "trim"), OptStr(a.Get(0, "chars"), a.line, "trim: chars"), true, true));
    };
    f["upper"] = [need_str](const Value& v, const CallArgs& a) {
      return Value::Str(CaseMap(need_str(v, a.line, "upper"), true));
    };
    f["lower"] = [need_str](const Value& v, const CallArgs& a) {
      return Value::Str(CaseMap(need_str(v, a.line, "lower"), false));
    };
    f["capitalize"] = [need_str](const Value& v, const CallArgs& a) {
      return Value::Str(Capitalize(need_str(v, a.line, "capitalize")));
    };
    f["title"] = [need_str](const Value& v, const CallArgs& a) {
      return Value::Str(Title(need_str(v, a.line, "title")));
    };
    f["string"] = [](const Value& v, const CallArgs&) { return Value::Str(ToStr(v)); };
    f["safe"] = [](const Value& v, const CallArgs&) { return v; };
    f["escape"] = f["e"] = [](const Value& v, const CallArgs&) {
      std::string o;
      for (char c : ToStr(v)) {
        switch (c) {
          case '&': o += "&amp;"; break;
          case '<': o += "&lt;"; break;
          case '>': o += "&gt;"; break;
          case '"': o += "&#34;"; break;
          case '\'': o += "&#39;"; break;
          default: o += c;
        }
      }
      return Value::Str(std::move(o));
    };
    f["length"] = f["count"] = [](const Value& v, const CallArgs& a) {
      switch (v.k) {
        case K::kUndefined: return Value::Int(0);
        case K::kString: return Value::Int(static_cast<int64_t>(CharOffsets(v.s).size()) - 1);
        case K::kList: return Value::Int(static_cast<int64_t>(v.list->size()));
        case K::kDict: return Value::Int(static_cast<int64_t>(v.dict->items.size()));
        default: Fail(a.line, absl::StrCat("object of type '", TypeName(v), "' has no len()"));
      }
    };
    f["default"] = f["d"] = [](const Value& v, const CallArgs& a) {
      const std::optional<Value> b = a.Get(1, "boolean");
      const bool use = v.undefined() || (b && Truthy(*b) && !Truthy(v));
      return use ? a.Get(0, "default_value").value_or(Value::Str("")) : v;
    };
    f["tojson"] = [](const Value& v, const CallArgs& a) {
      const std::optional<Value> ind = a.Get(0, "indent");
      int indent = -1;
      if (ind && ind->k != K::kNone) indent = static_cast<int>(std::clamp<int64_t>(ToIndex(*ind, a.line, "tojson: indent"), 0, 64));
      std::string o;
      ToJson(v, indent, 0, &o, a.line);
      return Value::Str(std::move(o));
    };
    f["first"] = [](const Value& v, const CallArgs& a) {
      ValueList items = Items(v, a.line);
      return items.empty() ? Value::Undefined("first of an empty sequence is undefined") : items.front();
    };
    f["last"] = [](const Value& v, const CallArgs& a) {
      ValueList items = Items(v, a.line);
      return items.empty() ? Value::Undefined("last of an empty sequence is undefined") : items.back();
    };
    f["list"] = [](const Value& v, const CallArgs& a) { return Value::List(Items(v, a.line)); };
    f["reverse"] = [](const Value& v, const CallArgs& a) {
      ValueList items = Items(v, a.line);
      std::reverse(items.begin(), items.end());
      if (!v.is_str()) return Value::List(std::move(items));
      std::string o;
      for (const Value& x : items) o += x.s;
      return Value::Str(std::move(o));
    };
    f["join"] = [](const Value& v, const CallArgs& a) {
      const std::string sep = a.Get(0, "d").has_value() ? ToStr(*a.Get(0, "d")) : "";
      const std::optional<Value> attr = a.Get(1, "attribute");
      std::string o;
      bool first = true;
      for (const Value& x : Items(v, a.line)) {
        if (!first) o += sep;
        first = false;
        o += ToStr(attr ? GetItem(x, *attr, SIZE_MAX, a.line) : x);
      }
      return Value::Str(std::move(o));
    };
    f["replace"] = [need_str](const Value& v, const CallArgs& a) {
      const std::optional<Value> c = a.Get(2, "count");
      return Value::Str(Replace(need_str(v, a.line, "replace"), ToStr(a.Get(0, "old").value_or(Value())),
                                ToStr(a.Get(1, "new").value_or(Value())),
                                c && c->k != K::kNone ? ToIndex(*c, a.line, "replace: count") : -1,
                                SIZE_MAX, a.line));
    };
    f["int"] = [](const Value& v, const CallArgs& a) {
      const Value dflt = a.Get(0, "default").value_or(Value::Int(0));
      if (v.k == K::kInt || v.k == K::kBool) return Value::Int(v.integer());
      if (v.k == K::kFloat && std::isfinite(v.f) && std::fabs(v.f) < 9.2e18) {
        return Value::Int(static_cast<int64_t>(v.f));
      }
      if (v.is_str()) {
        const std::string s = Strip(v.s, std::nullopt, true, true);
        int64_t x = 0;
        auto r = std::from_chars(s.data(), s.data() + s.size(), x);
        if (r.ec == std::errc() && r.ptr == s.data() + s.size()) return Value::Int(x);
      }
      return dflt;
    };
    f["float"] = [](const Value& v, const CallArgs& a) {
      const Value dflt = a.Get(0, "default").value_or(Value::Float(0));
      if (v.numeric()) return Value::Float(v.num());
      if (v.is_str()) {
        const std::string s = Strip(v.s, std::nullopt, true, true);
        char* end = nullptr;
        const double d = std::strtod(s.c_str(), &end);
        if (!s.empty() && end == s.c_str() + s.size()) return Value::Float(d);
      }
      return dflt;
    };
    f["abs"] = [](const Value& v, const CallArgs& a) {
      if (v.k == K::kFloat) return Value::Float(std::fabs(v.f));
      const int64_t x = ToIndex(v, a.line, "abs: value");
      if (x == std::numeric_limits<int64_t>::min()) Fail(a.line, "integer overflow");
      return Value::Int(x < 0 ? -x : x);
    };
    f["items"] = [](const Value& v, const CallArgs& a) {
      if (v.undefined()) return Value::List({});
      if (v.k != K::kDict) Fail(a.line, "items: a mapping is required");
      return DictMethod(v, "items").fn->call(a);
    };
    f["select"] = [](const Value& v, const CallArgs& a) { return SelectFilter(v, a, false, true); };
    f["reject"] = [](const Value& v, const CallArgs& a) { return SelectFilter(v, a, false, false); };
    f["selectattr"] = [](const Value& v, const CallArgs& a) { return SelectFilter(v, a, true, true); };
    f["rejectattr"] = [](const Value& v, const CallArgs& a) { return SelectFilter(v, a, true, false); };
    // sort / unique / min / max compare strings case-insensitively unless case_sensitive, as
    // jinja2 does; `attribute` picks what is compared.
    const auto sort_key = [](const Value& x, const CallArgs& a, size_t attr_pos) {
      const std::optional<Value> attr = a.Get(attr_pos, "attribute");
      Value k = attr ? GetItem(x, *attr, SIZE_MAX, a.line) : x;
      const std::optional<Value> cs = a.Get(SIZE_MAX, "case_sensitive");
      if (k.is_str() && !(cs && Truthy(*cs))) k.s = CaseMap(k.s, false);
      return k;
    };
    f["sort"] = [sort_key](const Value& v, const CallArgs& a) {
      ValueList items = Items(v, a.line);
      std::vector<std::pair<Value, size_t>> keys;
      for (size_t k = 0; k < items.size(); ++k) keys.emplace_back(sort_key(items[k], a, 2), k);
      const std::optional<Value> rev = a.Get(0, "reverse");
      const bool reverse = rev && Truthy(*rev);
      std::stable_sort(keys.begin(), keys.end(), [&](const auto& x, const auto& y) {
        return reverse ? Less(y.first, x.first, a.line) : Less(x.first, y.first, a.line);
      });
      ValueList out;
      for (const auto& [key, k] : keys) out.push_back(items[k]);
      return Value::List(std::move(out));
    };
    f["unique"] = [sort_key](const Value& v, const CallArgs& a) {
      ValueList out, seen;
      for (const Value& x : Items(v, a.line)) {
        Value key = sort_key(x, a, 1);
        if (std::none_of(seen.begin(), seen.end(), [&](const Value& y) { return Equal(y, key); })) {
          seen.push_back(std::move(key));
          out.push_back(x);
        }
      }
      return Value::List(std::move(out));
    };
    const auto extreme = [sort_key](bool want_max) {
      return [sort_key, want_max](const Value& v, const CallArgs& a) {
        ValueList items = Items(v, a.line);
        if (items.empty()) return Value::Undefined("min/max of an empty sequence is undefined");
        size_t best = 0;
        Value best_key = sort_key(items[0], a, 1);
        for (size_t k = 1; k < items.size(); ++k) {
          Value key = sort_key(items[k], a, 1);
          if (want_max ? Less(best_key, key, a.line) : Less(key, best_key, a.line)) {
            best = k;
            best_key = std::move(key);
          }
        }
        return items[best];
      };
    };
    f["min"] = extreme(false);
    f["max"] = extreme(true);
    f["sum"] = [](const Value& v, const CallArgs& a) {
      const std::optional<Value> attr = a.Get(0, "attribute");
      Value total = a.Get(1, "start").value_or(Value::Int(0));
      for (const Value& x : Items(v, a.line)) {
        const Value y = attr ? GetItem(x, *attr, SIZE_MAX, a.line) : x;
        if (!total.numeric() || !y.numeric()) Fail(a.line, "sum: numbers are required");
        if (total.k == Value::K::kFloat || y.k == Value::K::kFloat) {
          total = Value::Float(total.num() + y.num());
        } else if (int64_t r; __builtin_add_overflow(total.integer(), y.integer(), &r)) {
          Fail(a.line, "integer overflow");
        } else {
          total = Value::Int(r);
        }
      }
      return total;
    };
    f["dictsort"] = [](const Value& v, const CallArgs& a) {
      if (v.k != Value::K::kDict || v.dict->ns) Fail(a.line, "dictsort: a mapping is required");
      const std::optional<Value> cs = a.Get(0, "case_sensitive");
      const std::optional<Value> by = a.Get(1, "by");
      const std::optional<Value> rev = a.Get(2, "reverse");
      const int pos = by && by->is_str() && by->s == "value" ? 1 : 0;
      std::vector<std::pair<Value, Value>> rows;  // (key to sort by, [k, v])
      for (const auto& [k, x] : v.dict->items) {
        Value key = pos == 0 ? Value::Str(k) : x;
        if (key.is_str() && !(cs && Truthy(*cs))) key.s = CaseMap(key.s, false);
        rows.emplace_back(std::move(key), Value::Tuple({Value::Str(k), x}));
      }
      const bool reverse = rev && Truthy(*rev);
      std::stable_sort(rows.begin(), rows.end(), [&](const auto& x, const auto& y) {
        return reverse ? Less(y.first, x.first, a.line) : Less(x.first, y.first, a.line);
      });
      ValueList out;
      for (auto& r : rows) out.push_back(std::move(r.second));
      return Value::List(std::move(out));
    };
    f["indent"] = [need_str](const Value& v, const CallArgs& a) {
      const std::optional<Value> w = a.Get(0, "width");
      const std::string ind =
          w && w->is_str() ? w->s
                           : std::string(w ? static_cast<size_t>(std::clamp<int64_t>(
                                                 ToIndex(*w, a.line, "indent: width"), 0, 1024))
                                           : 4,
                                         ' ');
      const std::optional<Value> first = a.Get(1, "first");
      const std::optional<Value> blank = a.Get(2, "blank");
      // jinja2: (s + "\n").splitlines(), every line but the first indented (blank ones only
      // with blank=True), joined with "\n".
      std::vector<std::string> lines;
      const std::string text = need_str(v, a.line, "indent") + "\n";
      for (size_t p = 0; p < text.size();) {
        size_t q = text.find_first_of("\r\n", p);
        lines.push_back(text.substr(p, q - p));
        p = q + ((text[q] == '\r' && q + 1 < text.size() && text[q + 1] == '\n') ? 2 : 1);
      }
      std::string out = lines.empty() ? "" : lines[0];
      for (size_t k = 1; k < lines.size(); ++k) {
        out += "\n";
        if (!lines[k].empty() || (blank && Truthy(*blank))) out += ind;
        out += lines[k];
      }
      if (first && Truthy(*first)) out = ind + out;
      return Value::Str(std::move(out));
    };
    f["map"] = [](const Value& v, const CallArgs& a) {
      ValueList out;
      const std::optional<Value> attribute = a.Get(SIZE_MAX, "attribute");
      if (attribute) {
        const std::optional<Value> dflt = a.Get(SIZE_MAX, "default");
        for (const Value& x : Items(v, a.line)) {
          Value y = GetItem(x, *attribute, SIZE_MAX, a.line);
          out.push_back(y.undefined() && dflt ? *dflt : y);
        }
        return Value::List(std::move(out));
      }
      const std::string name = StrArg(a.Get(0, "filter"), a.line, "map: filter name");
      const auto it = Filters().find(name);
      if (it == Filters().end()) Fail(a.line, absl::StrCat("unknown filter '", name, "'"));
      CallArgs rest;
      rest.line = a.line;
      rest.pos.assign(a.pos.begin() + 1, a.pos.end());
      rest.kw = a.kw;
      for (const Value& x : Items(v, a.line)) out.push_back(it->second(x, rest));
      return Value::List(std::move(out));
    };
    return m;
  }();
  return *kFilters;
}

// ---------------------------------------------------------------------------------------------
// The tree walker.

enum class Flow { kNormal, kBreak, kContinue };

// Where RenderChatSpans' prefix renderings go: compared with the whole prompt as they are
// produced instead of stored (each is nearly the whole prompt, and there is one per message).
struct PrefixSink {
  const std::string* ref = nullptr;  // the whole prompt
  size_t max_tail = 0;               // bytes allowed after the output leaves `ref` (an EOS)
  size_t pos = 0;                    // bytes written that equal ref[0, pos)
  bool diverged = false;
  std::string tail;                  // what was written after diverging
};
struct Diverged {};  // thrown when more than max_tail bytes follow the divergence

class Interp {
 public:
  Interp(const ChatTemplateLimits& lim) : lim_(lim) {}
  // The render's own output (not a block set's capture) goes to `sink`.
  void SetSink(PrefixSink* sink, const std::string* top) {
    sink_ = sink;
    top_ = top;
  }

  void PushFrame() { frames_.emplace_back(); }
  void PopFrame() { frames_.pop_back(); }
  void Set(const std::string& name, Value v) { frames_.back()[name] = std::move(v); }

  Flow Exec(const Body& body, std::string* out) {
    for (const NodeP& n : body) {
      const Flow f = ExecNode(*n, out);
      if (f != Flow::kNormal) return f;
    }
    return Flow::kNormal;
  }

 private:
  void Emit(std::string* out, const std::string& s, int line) {
    if (sink_ != nullptr && out == top_) {
      PrefixSink& k = *sink_;
      if (!k.diverged) {
        const size_t m = std::min(s.size(), k.ref->size() - k.pos);
        const size_t same = std::mismatch(s.begin(), s.begin() + m, k.ref->begin() + k.pos).first -
                            s.begin();
        k.pos += same;
        if (same < s.size()) {
          k.diverged = true;
          k.tail.assign(s, same);
        }
      } else {
        k.tail += s;
      }
      if (k.tail.size() > k.max_tail) throw Diverged{};
      if (k.pos + k.tail.size() > lim_.max_output_bytes) {
        Fail(line, absl::StrCat("output exceeds the limit of ", lim_.max_output_bytes, " bytes"));
      }
      return;
    }
    out->append(s);
    if (out->size() > lim_.max_output_bytes) {
      Fail(line, absl::StrCat("output exceeds the limit of ", lim_.max_output_bytes, " bytes"));
    }
  }

  Value Lookup(const std::string& name) const {
    for (auto it = frames_.rbegin(); it != frames_.rend(); ++it) {
      auto f = it->find(name);
      if (f != it->end()) return f->second;
    }
    return Value::Undefined("'" + name + "' is undefined");
  }

  Flow ExecNode(const Node& n, std::string* out) {
    switch (n.k) {
      case Node::kText: Emit(out, n.text, n.line); return Flow::kNormal;
      case Node::kOutput: {
        const Value v = Eval(*n.expr);
        Emit(out, v.is_str() ? v.s : ToStr(v), n.line);  // a string is written without a copy
        return Flow::kNormal;
      }
      case Node::kIf:
        for (size_t b = 0; b < n.conds.size(); ++b) {
          if (n.conds[b] == nullptr || Truthy(Eval(*n.conds[b]))) return Exec(n.bodies[b], out);
        }
        return Flow::kNormal;
      case Node::kFor: return ExecFor(n, out);
      case Node::kSet: {
        Value v = Eval(*n.expr);
        if (!n.attr.empty()) {
          const Value ns = Lookup(n.targets[0]);
          if (ns.k != Value::K::kDict || !ns.dict->ns) {
            Fail(n.line, absl::StrCat("cannot assign '", n.targets[0], ".", n.attr,
                                      "': '", n.targets[0], "' is not a namespace()"));
          }
          ns.dict->Set(n.attr, std::move(v));
        } else {
          Assign(n.targets, std::move(v), n.line);
        }
        return Flow::kNormal;
      }
      case Node::kSetBlock: {
        std::string captured;
        Exec(n.bodies[0], &captured);
        Set(n.targets[0], Value::Str(std::move(captured)));
        return Flow::kNormal;
      }
      case Node::kBreak:
        if (loop_depth_ == 0) Fail(n.line, "'break' outside a loop");
        return Flow::kBreak;
      case Node::kContinue:
        if (loop_depth_ == 0) Fail(n.line, "'continue' outside a loop");
        return Flow::kContinue;
      case Node::kScope: return Exec(n.bodies[0], out);
      case Node::kMacro: {
        const Node* node = &n;
        Set(n.targets[0], MakeFunc(n.targets[0], [this, node](const CallArgs& a) {
              return CallMacro(*node, a);
            }));
        return Flow::kNormal;
      }
    }
    return Flow::kNormal;
  }

  // A macro runs in a scope of its own over the globals and the template's top level (as in
  // jinja2: not the caller's loop variables); its output is its value.
  Value CallMacro(const Node& n, const CallArgs& a) {
    const std::string& name = n.targets[0];
    const size_t nparams = n.targets.size() - 1;
    if (a.pos.size() > nparams) {
      Fail(a.line, absl::StrCat("macro '", name, "' takes not more than ", nparams, " argument(s)"));
    }
    for (const auto& [k, v] : a.kw) {
      if (std::find(n.targets.begin() + 1, n.targets.end(), k) == n.targets.end()) {
        Fail(a.line, absl::StrCat("macro '", name, "' takes no keyword argument '", k, "'"));
      }
    }
    if (++macro_depth_ > lim_.max_macro_depth) {
      Fail(a.line, absl::StrCat("macro calls nested deeper than ", lim_.max_macro_depth, " levels"));
    }
    std::vector<std::unordered_map<std::string, Value>> caller(frames_.begin() + 2, frames_.end());
    frames_.resize(2);
    PushFrame();
    for (size_t k = 0; k < nparams; ++k) {
      const std::string& p = n.targets[k + 1];
      std::optional<Value> v = a.Get(k, p.c_str());
      if (!v) v = n.conds[k] ? Eval(*n.conds[k]) : Value::Undefined("'" + p + "' is undefined");
      Set(p, *std::move(v));
    }
    const int loops = loop_depth_;
    loop_depth_ = 0;
    std::string out;
    Exec(n.bodies[0], &out);
    loop_depth_ = loops;
    frames_.resize(2);
    frames_.insert(frames_.end(), std::make_move_iterator(caller.begin()),
                   std::make_move_iterator(caller.end()));
    --macro_depth_;
    return Value::Str(std::move(out));
  }

  void Assign(const std::vector<std::string>& targets, Value v, int line) {
    if (targets.size() == 1) {
      Set(targets[0], std::move(v));
      return;
    }
    const ValueList items = Items(v, line);
    if (items.size() != targets.size()) {
      Fail(line, absl::StrCat("cannot unpack ", items.size(), " values into ", targets.size(),
                              " names"));
    }
    for (size_t k = 0; k < targets.size(); ++k) Set(targets[k], items[k]);
  }

  void Tick(int line) {
    if (++iterations_ > lim_.max_iterations) {
      Fail(line, absl::StrCat("more than ", lim_.max_iterations, " loop iterations"));
    }
  }

  Flow ExecFor(const Node& n, std::string* out) {
    ValueList items = Items(Eval(*n.expr), n.line);
    if (n.filter) {
      ValueList kept;
      for (Value& x : items) {
        Tick(n.line);
        PushFrame();
        Assign(n.targets, x, n.line);
        const bool keep = Truthy(Eval(*n.filter));
        PopFrame();
        if (keep) kept.push_back(std::move(x));
      }
      items = std::move(kept);
    }
    if (items.empty()) {
      if (n.bodies.size() > 1) return Exec(n.bodies[1], out);
      return Flow::kNormal;
    }
    const int64_t len = static_cast<int64_t>(items.size());
    ++loop_depth_;
    for (int64_t k = 0; k < len; ++k) {
      Tick(n.line);
      PushFrame();  // each iteration has a scope of its own, as in jinja2
      Assign(n.targets, items[k], n.line);
      Set("loop", MakeDict({{"index", Value::Int(k + 1)},
                            {"index0", Value::Int(k)},
                            {"revindex", Value::Int(len - k)},
                            {"revindex0", Value::Int(len - k - 1)},
                            {"first", Value::Bool(k == 0)},
                            {"last", Value::Bool(k == len - 1)},
                            {"length", Value::Int(len)},
                            {"depth", Value::Int(1)},
                            {"depth0", Value::Int(0)},
                            {"previtem", k > 0 ? items[k - 1] : Value::Undefined("'loop.previtem' is undefined")},
                            {"nextitem", k + 1 < len ? items[k + 1] : Value::Undefined("'loop.nextitem' is undefined")}}));
      const Flow f = Exec(n.bodies[0], out);
      PopFrame();
      if (f == Flow::kBreak) break;
    }
    --loop_depth_;
    return Flow::kNormal;
  }

  CallArgs EvalArgs(const Expr& e) {
    CallArgs a;
    a.line = e.line;
    const size_t nkw = e.kw.size();
    for (size_t k = 1; k < e.kids.size(); ++k) {
      Value v = Eval(*e.kids[k]);
      if (k + nkw >= e.kids.size()) {
        a.kw.emplace_back(e.kw[k - (e.kids.size() - nkw)], std::move(v));
      } else {
        a.pos.push_back(std::move(v));
      }
    }
    return a;
  }

  // By value: a + b + c appends to the left operand in place instead of copying it each time.
  Value Arith(const std::string& op, Value a, const Value& b, int line) {
    if (a.undefined()) FailUndefined(a, line);
    if (b.undefined()) FailUndefined(b, line);
    const auto bad = [&]() -> Value {
      Fail(line, absl::StrCat("unsupported operand types for ", op, ": '", TypeName(a), "' and '",
                              TypeName(b), "'"));
    };
    if (op == "+") {
      if (a.is_str() && b.is_str()) {
        CheckSize(a.s.size() + b.s.size(), lim_.max_output_bytes, line);
        a.s += b.s;
        return a;
      }
      if (a.k == Value::K::kList && b.k == Value::K::kList) {
        ValueList o = *a.list;
        o.insert(o.end(), b.list->begin(), b.list->end());
        return Value::List(std::move(o));
      }
    }
    const auto is_seq = [](const Value& v) { return v.is_str() || v.k == Value::K::kList; };
    const auto is_int = [](const Value& v) { return v.k == Value::K::kInt || v.k == Value::K::kBool; };
    if (op == "*" && ((is_seq(a) && is_int(b)) || (is_seq(b) && is_int(a)))) {
      const Value& seq = a.numeric() ? b : a;
      const int64_t n = std::max<int64_t>(0, (a.numeric() ? a : b).integer());
      const size_t unit = seq.is_str() ? seq.s.size() : seq.list->size() * 64;
      if (unit > 0 && static_cast<uint64_t>(n) > lim_.max_output_bytes / unit) {
        CheckSize(SIZE_MAX, lim_.max_output_bytes, line);
      }
      if (seq.is_str()) {
        std::string o;
        for (int64_t k = 0; k < n; ++k) o += seq.s;
        return Value::Str(std::move(o));
      }
      ValueList o;
      for (int64_t k = 0; k < n; ++k) o.insert(o.end(), seq.list->begin(), seq.list->end());
      return Value::List(std::move(o));
    }
    if (!a.numeric() || !b.numeric()) {
      if (op == "%" && a.is_str()) Fail(line, "string formatting with '%' is not supported");
      return bad();
    }
    const bool fl = a.k == Value::K::kFloat || b.k == Value::K::kFloat;
    if (op == "/") {
      if (b.num() == 0) Fail(line, "division by zero");
      return Value::Float(a.num() / b.num());
    }
    if (fl) {
      const double x = a.num(), y = b.num();
      if (op == "+") return Value::Float(x + y);
      if (op == "-") return Value::Float(x - y);
      if (op == "*") return Value::Float(x * y);
      if (op == "**") return Value::Float(std::pow(x, y));
      if (y == 0) Fail(line, "division by zero");
      if (op == "//") return Value::Float(std::floor(x / y));
      if (op == "%") {
        double r = std::fmod(x, y);
        if (r != 0 && ((r < 0) != (y < 0))) r += y;
        return Value::Float(r);
      }
      return bad();
    }
    const int64_t x = a.integer(), y = b.integer();
    int64_t r = 0;
    bool overflow = false;
    if (op == "+") {
      overflow = __builtin_add_overflow(x, y, &r);
    } else if (op == "-") {
      overflow = __builtin_sub_overflow(x, y, &r);
    } else if (op == "*") {
      overflow = __builtin_mul_overflow(x, y, &r);
    } else if (op == "**") {
      if (y < 0) return Value::Float(std::pow(static_cast<double>(x), static_cast<double>(y)));
      r = 1;
      for (int64_t k = 0; k < y && !overflow; ++k) overflow = __builtin_mul_overflow(r, x, &r);
    } else {
      if (y == 0) Fail(line, "division by zero");
      if (x == std::numeric_limits<int64_t>::min() && y == -1) {
        overflow = true;
      } else if (op == "//") {
        r = x / y;
        if ((x % y != 0) && ((x < 0) != (y < 0))) --r;  // floor, as Python
      } else {
        r = x % y;
        if (r != 0 && ((r < 0) != (y < 0))) r += y;
      }
    }
    if (overflow) Fail(line, "integer overflow");
    return Value::Int(r);
  }

  bool Contains(const Value& seq, const Value& x, int line) {
    if (seq.is_str()) {
      if (!x.is_str()) Fail(line, "'in <string>' requires a string on the left");
      return seq.s.find(x.s) != std::string::npos;
    }
    if (seq.k == Value::K::kDict) return x.is_str() && seq.dict->Find(x.s) != nullptr;
    if (seq.k == Value::K::kList) {
      for (const Value& y : *seq.list) {
        if (Equal(x, y)) return true;
      }
      return false;
    }
    if (seq.undefined()) return false;
    Fail(line, absl::StrCat("argument of type '", TypeName(seq), "' is not iterable"));
  }

 public:
  Value Eval(const Expr& e) {
    switch (e.k) {
      case Expr::kLit: return e.lit;
      case Expr::kName: return Lookup(e.name);
      case Expr::kAttr: return GetAttr(Eval(*e.kids[0]), e.name, lim_.max_output_bytes, e.line);
      case Expr::kItem:
        return GetItem(Eval(*e.kids[0]), Eval(*e.kids[1]), lim_.max_output_bytes, e.line);
      case Expr::kSlice: {
        const Value obj = Eval(*e.kids[0]);
        std::optional<int64_t> p[3];
        for (int k = 0; k < 3; ++k) {
          if (!e.kids[k + 1]) continue;
          const Value v = Eval(*e.kids[k + 1]);
          if (v.k != Value::K::kNone) p[k] = ToIndex(v, e.line, "slice index");
        }
        return Slice(obj, p[0], p[1], p[2], e.line);
      }
      case Expr::kCall: {
        const Value f = Eval(*e.kids[0]);
        if (f.undefined()) FailUndefined(f, e.line);
        if (f.k != Value::K::kFunc) {
          Fail(e.line, absl::StrCat("'", TypeName(f), "' object is not callable"));
        }
        return f.fn->call(EvalArgs(e));
      }
      case Expr::kFilter: {
        const Value in = Eval(*e.kids[0]);
        return Filters().at(e.name)(in, EvalArgs(e));
      }
      case Expr::kTest: {
        const Value in = Eval(*e.kids[0]);
        const bool r = RunTest(e.name, in, EvalArgs(e));
        return Value::Bool(r != e.negate);
      }
      case Expr::kNeg:
      case Expr::kPos: {
        const Value v = Eval(*e.kids[0]);
        if (v.undefined()) FailUndefined(v, e.line);
        if (!v.numeric()) Fail(e.line, absl::StrCat("bad operand type for unary -: '", TypeName(v), "'"));
        if (e.k == Expr::kPos) return v.k == Value::K::kBool ? Value::Int(v.b) : v;
        if (v.k == Value::K::kFloat) return Value::Float(-v.f);
        return Arith("-", Value::Int(0), v, e.line);
      }
      case Expr::kNot: return Value::Bool(!Truthy(Eval(*e.kids[0])));
      case Expr::kAnd: {  // Python returns the deciding operand
        Value a = Eval(*e.kids[0]);
        return Truthy(a) ? Eval(*e.kids[1]) : a;
      }
      case Expr::kOr: {
        Value a = Eval(*e.kids[0]);
        return Truthy(a) ? a : Eval(*e.kids[1]);
      }
      case Expr::kBin: return Arith(e.name, Eval(*e.kids[0]), Eval(*e.kids[1]), e.line);
      case Expr::kConcat: {
        std::string o;
        for (const ExprP& k : e.kids) {
          o += ToStr(Eval(*k));
          CheckSize(o.size(), lim_.max_output_bytes, e.line);
        }
        return Value::Str(std::move(o));
      }
      case Expr::kCompare: {
        Value left = Eval(*e.kids[0]);
        for (size_t k = 0; k < e.ops.size(); ++k) {
          Value right = Eval(*e.kids[k + 1]);
          const std::string& op = e.ops[k];
          bool r;
          if (op == "==") r = Equal(left, right);
          else if (op == "!=") r = !Equal(left, right);
          else if (op == "<") r = Less(left, right, e.line);
          else if (op == ">") r = Less(right, left, e.line);
          else if (op == "<=") r = !Less(right, left, e.line);
          else if (op == ">=") r = !Less(left, right, e.line);
          else if (op == "in") r = Contains(right, left, e.line);
          else r = !Contains(right, left, e.line);
          if (!r) return Value::Bool(false);
          left = std::move(right);
        }
        return Value::Bool(true);
      }
      case Expr::kCond:
        if (Truthy(Eval(*e.kids[0]))) return Eval(*e.kids[1]);
        return e.kids[2] ? Eval(*e.kids[2]) : Value::Undefined("a conditional without else is undefined");
      case Expr::kList: {
        ValueList o;
        for (const ExprP& k : e.kids) o.push_back(Eval(*k));
        return e.tuple ? Value::Tuple(std::move(o)) : Value::List(std::move(o));
      }
      case Expr::kDict: {
        ValueDict d;  // a later duplicate key replaces the value, in the first one's place
        for (size_t k = 0; k + 1 < e.kids.size(); k += 2) {
          const Value key = Eval(*e.kids[k]);
          if (!key.is_str()) Fail(e.line, "dict keys must be strings");
          d.Set(key.s, Eval(*e.kids[k + 1]));
        }
        return MakeDict(std::move(d.items));
      }
    }
    Fail(e.line, "unknown expression");
  }

 private:
  const ChatTemplateLimits& lim_;
  PrefixSink* sink_ = nullptr;
  const std::string* top_ = nullptr;
  std::vector<std::unordered_map<std::string, Value>> frames_;
  int64_t iterations_ = 0;
  int loop_depth_ = 0;
  int macro_depth_ = 0;
};

Value FromJson(const json& j, int depth) {
  if (depth > 128) Fail(0, "context JSON nested too deeply");
  switch (j.type()) {
    case json::value_t::null: return Value::None();
    case json::value_t::boolean: return Value::Bool(j.get<bool>());
    case json::value_t::number_integer: return Value::Int(j.get<int64_t>());
    case json::value_t::number_unsigned: {
      const uint64_t u = j.get<uint64_t>();
      if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return Value::Float(static_cast<double>(u));
      return Value::Int(static_cast<int64_t>(u));
    }
    case json::value_t::number_float: return Value::Float(j.get<double>());
    case json::value_t::string: return Value::Str(j.get<std::string>());
    case json::value_t::array: {
      ValueList o;
      for (const json& x : j) o.push_back(FromJson(x, depth + 1));
      return Value::List(std::move(o));
    }
    case json::value_t::object: {
      std::vector<std::pair<std::string, Value>> items;
      for (auto it = j.begin(); it != j.end(); ++it) items.emplace_back(it.key(), FromJson(it.value(), depth + 1));
      return MakeDict(std::move(items));
    }
    default: Fail(0, "unsupported JSON value in the context");
  }
}

}  // namespace

struct ChatTemplate::Impl {
  ChatTemplateLimits limits;
  Body body;

  // With a sink the output goes there (the returned string is empty); a divergence beyond the
  // sink's max_tail is ABORTED.
  absl::StatusOr<std::string> Run(const std::vector<std::pair<std::string, Value>>& vars,
                                  PrefixSink* sink = nullptr) const {
    // A namespace can hold itself (ns.me = ns): its attributes are cleared after the render so
    // the reference cycle does not outlive it.
    std::vector<std::weak_ptr<ValueDict>> namespaces;
    struct ClearNamespaces {
      std::vector<std::weak_ptr<ValueDict>>* ns;
      ~ClearNamespaces() {
        for (auto& w : *ns) {
          if (auto d = w.lock()) d->items.clear();
        }
      }
    } clear{&namespaces};
    try {
      Interp in(limits);
      in.PushFrame();  // globals
      in.Set("raise_exception", MakeFunc("raise_exception", [](const CallArgs& a) -> Value {
               const std::optional<Value> m = a.Get(0, "message");
               throw TemplateError{"chat template: " + (m ? ToStr(*m) : std::string("error"))};
             }));
      in.Set("namespace", MakeFunc("namespace", [&namespaces](const CallArgs& a) {
               Value ns = MakeDict({}, /*ns=*/true);
               namespaces.push_back(ns.dict);
               if (!a.pos.empty() && a.pos[0].k == Value::K::kDict) {
                 for (const auto& [k, v] : a.pos[0].dict->items) ns.dict->Set(k, v);
               }
               for (const auto& [k, v] : a.kw) ns.dict->Set(k, v);
               return ns;
             }));
      const int64_t max_items = limits.max_iterations;
      in.Set("range", MakeFunc("range", [max_items](const CallArgs& a) {
               int64_t lo = 0, hi = 0, step = 1;
               if (a.pos.size() == 1) {
                 hi = ToIndex(a.pos[0], a.line, "range: stop");
               } else if (a.pos.size() >= 2) {
                 lo = ToIndex(a.pos[0], a.line, "range: start");
                 hi = ToIndex(a.pos[1], a.line, "range: stop");
                 if (a.pos.size() > 2) step = ToIndex(a.pos[2], a.line, "range: step");
               }
               if (step == 0) Fail(a.line, "range: step must not be zero");
               ValueList o;
               for (int64_t k = lo; step > 0 ? k < hi : k > hi; k += step) {
                 if (static_cast<int64_t>(o.size()) >= max_items) {
                   Fail(a.line, absl::StrCat("range of more than ", max_items, " items"));
                 }
                 o.push_back(Value::Int(k));
               }
               return Value::List(std::move(o));
             }));
      // transformers' strftime_now: the local time, formatted (templates put today's date into
      // the system prompt with it).
      in.Set("strftime_now", MakeFunc("strftime_now", [](const CallArgs& a) {
               const std::string fmt = StrArg(a.Get(0, "format"), a.line, "strftime_now: format");
               const std::time_t now = std::time(nullptr);
               std::tm tm{};
               localtime_r(&now, &tm);
               char buf[256];
               const size_t n = std::strftime(buf, sizeof(buf), fmt.c_str(), &tm);
               return Value::Str(std::string(buf, n));
             }));
      in.Set("dict", MakeFunc("dict", [](const CallArgs& a) {
               ValueDict d;
               for (const auto& [k, v] : a.kw) d.Set(k, v);
               return MakeDict(std::move(d.items));
             }));
      for (const auto& [k, v] : vars) in.Set(k, v);
      in.PushFrame();  // the template's own top-level assignments
      std::string out;
      in.SetSink(sink, &out);
      in.Exec(body, &out);
      return out;
    } catch (const Diverged&) {
      return absl::AbortedError("the rendering left the reference text");
    } catch (const TemplateError& e) {
      return absl::InvalidArgumentError(e.message);
    } catch (const std::bad_alloc&) {
      return absl::ResourceExhaustedError("chat template: out of memory while rendering");
    }
  }
};

ChatTemplate::ChatTemplate(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ChatTemplate::~ChatTemplate() = default;

absl::StatusOr<std::shared_ptr<const ChatTemplate>> ChatTemplate::Parse(
    std::string_view source, const ChatTemplateLimits& limits) {
  if (source.size() > limits.max_source_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("chat template of ", source.size(),
                                                   " bytes exceeds the limit of ",
                                                   limits.max_source_bytes));
  }
  auto impl = std::make_unique<Impl>();
  impl->limits = limits;
  try {
    Parser p(Lexer(std::string(source)).Run(), limits.max_depth);
    impl->body = p.ParseTemplate();
  } catch (const TemplateError& e) {
    return absl::InvalidArgumentError("chat template: " + e.message);
  }
  return std::shared_ptr<const ChatTemplate>(new ChatTemplate(std::move(impl)));
}

namespace {

std::vector<std::pair<std::string, Value>> ChatVars(std::span<const ChatMessage> messages,
                                                    const ChatTemplateVars& vars) {
  ValueList msgs;
  for (const ChatMessage& m : messages) {
    msgs.push_back(MakeDict({{"role", Value::Str(m.role)}, {"content", Value::Str(m.content)}}));
  }
  return {{"messages", Value::List(std::move(msgs))},
          {"add_generation_prompt", Value::Bool(vars.add_generation_prompt)},
          {"bos_token", Value::Str(vars.bos_token)},
          {"eos_token", Value::Str(vars.eos_token)}};
}

}  // namespace

absl::StatusOr<std::string> ChatTemplate::Render(std::span<const ChatMessage> messages,
                                                 const ChatTemplateVars& vars) const {
  return impl_->Run(ChatVars(messages, vars));
}

absl::StatusOr<std::string> ChatTemplate::RenderJson(std::string_view context_json) const {
  const json j = json::parse(context_json, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError("chat template context must be a JSON object");
  }
  std::vector<std::pair<std::string, Value>> vars;
  try {
    for (auto it = j.begin(); it != j.end(); ++it) vars.emplace_back(it.key(), FromJson(it.value(), 0));
  } catch (const TemplateError& e) {
    return absl::InvalidArgumentError(e.message);
  }
  return impl_->Run(vars);
}

constexpr size_t kMaxSpanMessages = 256;

absl::StatusOr<ChatSpans> RenderChatSpans(const ChatTemplate& t,
                                          std::span<const ChatMessage> messages,
                                          const ChatTemplateVars& vars) {
  ChatSpans out;
  ASSIGN_OR_RETURN(out.text, t.Render(messages, vars));
  // The spans cost one rendering per message, quadratic in the conversation: bounded.
  if (messages.size() > kMaxSpanMessages) {
    out.fallback_reason = absl::StrCat("more than ", kMaxSpanMessages, " messages");
    return out;
  }
  ChatTemplateVars partial = vars;
  partial.add_generation_prompt = false;
  // Every rendering of messages[0..i] must be a prefix of the whole prompt, at a position that
  // never goes back; then span i lies between the ends of renderings i-1 and i. Two candidates
  // are checked in one pass: as rendered, and without a closing EOS (Phi-3 ends a conversation
  // without a generation prompt with EOS). Renderings are compared as they are produced, never
  // stored, and one that leaves the prompt by more than an EOS stops at once.
  const std::string& eos = vars.eos_token;
  const std::string& text = out.text;
  std::vector<size_t> ends[2];
  bool ok[2] = {true, !eos.empty()};
  if (messages.empty()) ok[0] = ok[1] = false;
  for (size_t i = 1; i <= messages.size() && (ok[0] || ok[1]); ++i) {
    PrefixSink sink;
    sink.ref = &text;
    sink.max_tail = ok[1] ? eos.size() : 0;
    absl::StatusOr<std::string> r = t.impl_->Run(ChatVars(messages.subspan(0, i), partial), &sink);
    if (r.status().code() == absl::StatusCode::kAborted) {  // not a prefix: fall back
      ok[0] = ok[1] = false;
      break;
    }
    if (!r.ok()) {
      // E.g. a template that insists on a user turn last: the whole prompt is still valid.
      out.fallback_reason = absl::StrCat("rendering the first ", i, " messages failed: ",
                                         r.status().message());
      return out;
    }
    const size_t len = sink.pos + sink.tail.size();
    // As rendered: the whole rendering is a prefix of the prompt.
    ok[0] = ok[0] && !sink.diverged && (ends[0].empty() || ends[0].back() <= len);
    ends[0].push_back(len);
    // Without a closing EOS: text[0, len - |eos|) + eos, the first part within the prefix.
    if (ok[1]) {
      const size_t cut = len - std::min(len, eos.size());
      std::string last = sink.tail;
      if (last.size() < eos.size()) {
        const size_t need = std::min(eos.size() - last.size(), sink.pos);
        last = text.substr(sink.pos - need, need) + last;
      }
      ok[1] = len >= eos.size() && cut <= sink.pos && last == eos &&
              (ends[1].empty() || ends[1].back() <= cut);
      ends[1].push_back(cut);
    }
  }
  for (int c = 0; c < 2; ++c) {
    if (!ok[c]) continue;
    out.per_message = true;
    size_t prev = 0;
    for (size_t e : ends[c]) {
      out.spans.push_back(text.substr(prev, e - prev));
      prev = e;
    }
    out.suffix = text.substr(prev);
    return out;
  }
  out.fallback_reason =
      "the rendering of a conversation is not a prefix of the rendering of its continuation";
  return out;
}

}  // namespace sparsex
