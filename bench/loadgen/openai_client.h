// The OpenAI chat-completions side of sparsex-loadgen (--api openai): requests sent as a real
// client sends them (messages, no segment marks), read as a stream of Server-Sent Events.
// No HTTP library: the router answers HTTP/1.1 with `Connection: close`, chunked for streams
// (docs/api.md), which a small decoder handles; the pieces are separate so the unit test can
// feed them bytes without a server.
//
//   ChatMessages / ChatBody   a RequestSpec as chat messages and the request's JSON body
//   HttpResponseDecoder       status line, headers, chunked or plain body, fed in any pieces
//   SseDecoder                `data:` payloads of an event stream, fed in any pieces
//   ParseChatChunk            one payload: content delta, finish reason, usage, error
//   PostStream                a blocking POST whose body bytes go to a callback
#pragma once

#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "bench/loadgen/workloads.h"

namespace sparsex::loadgen {

// The request's segments as chat messages: consecutive segments of one role (RoleOf) are
// pasted into one message, in order, so documents and the question become one user message
// and the server sees no segment boundary the client drew. Text segments only.
std::vector<std::pair<Role, std::string>> ChatMessages(const RequestSpec& r);

struct ChatOptions {
  std::string model;
  int max_tokens = 16;
  double temperature = 0;
  int64_t seed = -1;  // < 0: not sent
  bool ignore_eos = true;
  // SparseX's `reuse` extension; not sent when every field is at its default.
  bool reuse_enable = true;
  std::string selector;
  double recompute_ratio = -1;
  int store_after_misses = 0;
};

// The JSON body of POST /v1/chat/completions: messages, max_tokens, temperature, stream with
// stream_options.include_usage (the usage chunk carries the reused-token figures).
std::string ChatBody(const RequestSpec& r, const ChatOptions& o);

// Incremental HTTP/1.1 response decoder. Feed() every byte read; body bytes (de-chunked) go to
// `on_body`. done() once a chunked body's last chunk or Content-Length bytes arrived; a body
// delimited by the connection's close is complete at Finish().
class HttpResponseDecoder {
 public:
  explicit HttpResponseDecoder(std::function<void(absl::string_view)> on_body)
      : on_body_(std::move(on_body)) {}
  absl::Status Feed(absl::string_view bytes);
  // The connection closed: OK when the response was complete (or close-delimited).
  absl::Status Finish() const;
  bool head_done() const { return head_done_; }
  bool done() const { return done_; }
  int status() const { return status_; }
  // Lower-cased header names.
  const std::map<std::string, std::string>& headers() const { return headers_; }

 private:
  absl::Status ParseHead();
  absl::Status FeedBody(absl::string_view bytes);
  std::function<void(absl::string_view)> on_body_;
  std::string buf_;  // bytes not consumed yet
  bool head_done_ = false, done_ = false, chunked_ = false, has_length_ = false;
  int status_ = 0;
  size_t length_left_ = 0;  // Content-Length bytes still to come
  size_t chunk_left_ = 0;   // chunked: data bytes left in the current chunk
  enum class ChunkState { kSize, kData, kDataCrlf, kTrailer } chunk_state_ = ChunkState::kSize;
  std::map<std::string, std::string> headers_;
};

// Server-Sent Events: returns the `data:` payload of each event completed by `bytes` (lines
// ending in LF or CRLF; an event ends at a blank line; several data lines joined by LF).
class SseDecoder {
 public:
  std::vector<std::string> Feed(absl::string_view bytes);

 private:
  std::string line_, data_;
  bool has_data_ = false;
};

// One `data:` payload of a chat stream ("[DONE]" sets done).
struct ChatChunk {
  bool done = false;
  std::string content;        // choices[0].delta.content ("" when none)
  std::string finish_reason;  // choices[0].finish_reason when set
  bool has_usage = false;
  // usage: prompt_tokens, completion_tokens, cached_tokens (prompt_tokens_details), and every
  // number of usage.sparsex by its name.
  std::map<std::string, double> usage;
  std::string worker;  // usage.sparsex.worker
  std::string error;   // {"error": {"message": ...}} (an error after the stream started)
};
absl::StatusOr<ChatChunk> ParseChatChunk(const std::string& data);

// An error body's message ({"error": {"message": ...}}), or the body itself, shortened.
std::string HttpErrorMessage(const std::string& body);

// POST `body` to http://host:port/path with a deadline (also sent as X-Request-Timeout-Ms);
// `on_body` gets the HTTP status and the response body's bytes as they arrive (de-chunked).
// The returned status is the transport's (connect, send, read, deadline: DEADLINE_EXCEEDED,
// malformed response); the HTTP status is in *http_status (0 before a status line).
// api_key: sent as "Authorization: Bearer <key>" when not empty.
absl::Status PostStream(const std::string& host, int port, const std::string& path,
                        const std::string& body, int timeout_ms, const std::string& api_key,
                        const std::function<void(int, absl::string_view)>& on_body,
                        int* http_status);
// GET http://host:port/path: the whole body.
absl::Status HttpGet(const std::string& host, int port, const std::string& path, int timeout_ms,
                     int* http_status, std::string* body);

}  // namespace sparsex::loadgen
