#include "testing/server_process.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <thread>

extern char** environ;

namespace sparsex::cache::testing {

absl::StatusOr<std::unique_ptr<ChildProcess>> ChildProcess::Spawn(
    const std::vector<std::string>& argv, const std::string& log_path,
    const std::vector<std::string>& env) {
  if (argv.empty()) return absl::InvalidArgumentError("spawn: empty argv");
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  if (!log_path.empty()) {
    posix_spawn_file_actions_addopen(&fa, 1, log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND,
                                     0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
  }
  posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  std::vector<std::string> envs;
  for (char** e = environ; *e != nullptr; ++e) envs.emplace_back(*e);
  for (const auto& e : env) envs.push_back(e);
  std::vector<char*> envp;
  for (auto& e : envs) envp.push_back(e.data());
  envp.push_back(nullptr);
  // The child must not inherit blocked signals (e.g. a test runner's mask).
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t none;
  sigemptyset(&none);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK);
  pid_t pid = -1;
  int rc = posix_spawn(&pid, argv[0].c_str(), &fa, &attr, args.data(), envp.data());
  posix_spawn_file_actions_destroy(&fa);
  posix_spawnattr_destroy(&attr);
  if (rc != 0) {
    return absl::UnavailableError(absl::StrCat("spawn ", argv[0], ": ", std::strerror(rc)));
  }
  auto c = std::unique_ptr<ChildProcess>(new ChildProcess());
  c->pid_ = pid;
  return c;
}

ChildProcess::~ChildProcess() {
  if (pid_ > 0 && !reaped_) {
    ::kill(pid_, SIGKILL);
    (void)Wait(std::chrono::seconds(10));
  }
}

bool ChildProcess::Running() {
  if (reaped_) return false;
  int st = 0;
  pid_t r = waitpid(pid_, &st, WNOHANG);
  if (r == pid_) {
    reaped_ = true;
    status_ = st;
    return false;
  }
  return true;
}

void ChildProcess::Signal(int sig) {
  if (!reaped_ && pid_ > 0) ::kill(pid_, sig);
}

absl::StatusOr<int> ChildProcess::Wait(std::chrono::milliseconds timeout) {
  const auto until = std::chrono::steady_clock::now() + timeout;
  while (Running()) {
    if (std::chrono::steady_clock::now() > until) {
      return absl::DeadlineExceededError(absl::StrCat("pid ", pid_, " still running"));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return status_;
}

void ChildProcess::Stop(std::chrono::milliseconds grace) {
  if (reaped_) return;
  Signal(SIGTERM);
  if (!Wait(grace).ok()) {
    Signal(SIGKILL);
    (void)Wait(std::chrono::seconds(10));
  }
}

absl::StatusOr<std::unique_ptr<ServerProcess>> ServerProcess::Start(
    const std::string& bin_dir, const std::vector<std::string>& args,
    const std::string& work_dir, std::chrono::milliseconds timeout,
    const std::vector<std::string>& env) {
  auto s = std::unique_ptr<ServerProcess>(new ServerProcess());
  const std::string ready = work_dir + "/ready.json";
  std::remove(ready.c_str());
  s->log_path_ = work_dir + "/server.log";
  std::vector<std::string> argv = {bin_dir + "/sparsex-cache-server", "--ready_file=" + ready};
  bool has_grpc = false, has_metrics = false, has_security = false;
  for (const auto& a : args) {
    has_grpc |= a.rfind("--grpc_port", 0) == 0;
    has_metrics |= a.rfind("--metrics_port", 0) == 0;
    has_security |= a.rfind("--tls_", 0) == 0 || a.rfind("--insecure_loopback", 0) == 0;
  }
  if (!has_grpc) argv.push_back("--grpc_port=0");
  if (!has_metrics) argv.push_back("--metrics_port=0");
  // Test servers listen on 127.0.0.1; without TLS flags they run plaintext, which the server
  // accepts only when told so.
  if (!has_security) argv.push_back("--insecure_loopback");
  argv.insert(argv.end(), args.begin(), args.end());
  ASSIGN_OR_RETURN(s->child_, ChildProcess::Spawn(argv, s->log_path_, env));
  const auto until = std::chrono::steady_clock::now() + timeout;
  const std::regex re(R"re("grpc_port":(\d+),"metrics_port":(-?\d+))re");
  for (;;) {
    std::ifstream in(ready);
    std::stringstream ss;
    ss << in.rdbuf();
    std::smatch m;
    const std::string text = ss.str();
    if (std::regex_search(text, m, re)) {
      s->grpc_port_ = std::stoi(m[1]);
      s->metrics_port_ = std::stoi(m[2]);
      s->address_ = absl::StrCat("127.0.0.1:", s->grpc_port_);
      return s;
    }
    if (!s->child_->Running()) {
      return absl::UnavailableError("cache server exited before ready: " + s->Log());
    }
    if (std::chrono::steady_clock::now() > until) {
      return absl::DeadlineExceededError("cache server not ready in time: " + s->Log());
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

std::string ServerProcess::Log() const {
  std::ifstream in(log_path_);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string BinDir() {
  if (const char* d = std::getenv("SPARSEX_BIN_DIR"); d != nullptr && *d != '\0') return d;
  std::error_code ec;
  auto p = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? "." : p.parent_path().string();
}

std::string MakeTempDir(const std::string& prefix) {
  const char* t = std::getenv("TMPDIR");
  std::string templ = std::string(t != nullptr && *t != '\0' ? t : "/tmp") + "/" + prefix +
                      "XXXXXX";
  char* d = mkdtemp(templ.data());
  return d != nullptr ? std::string(d) : std::string();
}

void RemoveTree(const std::string& path) {
  if (path.empty() || path == "/") return;
  std::error_code ec;
  std::filesystem::remove_all(path, ec);
}

absl::StatusOr<std::string> HttpGet(int port, const std::string& path) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::UnavailableError("socket");
  timeval tv{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    close(fd);
    return absl::UnavailableError(absl::StrCat("connect to port ", port));
  }
  const std::string req = "GET " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
  if (write(fd, req.data(), req.size()) != static_cast<ssize_t>(req.size())) {
    close(fd);
    return absl::UnavailableError("write");
  }
  std::string resp;
  char buf[65536];
  for (;;) {
    ssize_t n = read(fd, buf, sizeof buf);
    if (n <= 0) break;
    resp.append(buf, static_cast<size_t>(n));
  }
  close(fd);
  auto sp = resp.find(' ');
  if (sp == std::string::npos) return absl::UnavailableError("bad http reply");
  const int code = std::atoi(resp.c_str() + sp + 1);
  auto body = resp.find("\r\n\r\n");
  std::string b = body == std::string::npos ? "" : resp.substr(body + 4);
  if (code != 200) {
    return absl::Status(code == 503 ? absl::StatusCode::kUnavailable
                                    : absl::StatusCode::kUnknown,
                        absl::StrCat("http ", code, ": ", b));
  }
  return b;
}

absl::StatusOr<std::pair<int, std::string>> RunCommand(const std::string& cmd,
                                                       std::chrono::milliseconds timeout) {
  char templ[] = "/tmp/sparsex-cmd-XXXXXX";
  int fd = mkstemp(templ);
  if (fd < 0) return absl::UnavailableError("mkstemp");
  close(fd);
  ASSIGN_OR_RETURN(auto child, ChildProcess::Spawn({"/bin/sh", "-c", cmd}, templ));
  auto st = child->Wait(timeout);
  if (!st.ok()) {
    child->Signal(SIGKILL);
    (void)child->Wait(std::chrono::seconds(5));
  }
  std::ifstream in(templ);
  std::stringstream ss;
  ss << in.rdbuf();
  std::remove(templ);
  if (!st.ok()) return absl::DeadlineExceededError("command timed out: " + cmd + "\n" + ss.str());
  int code = WIFEXITED(*st) ? WEXITSTATUS(*st) : 128 + WTERMSIG(*st);
  return std::make_pair(code, ss.str());
}

}  // namespace sparsex::cache::testing
