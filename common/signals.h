// Termination signals for service mains: InstallTerminationHandler() (call first in main)
// makes SIGTERM and SIGINT write to a pipe, whatever thread receives them (libraries may start
// threads before main, so blocking the signals in main alone is not enough); WaitForTermination
// blocks until one arrives and returns its number. SIGPIPE is ignored.
//
//   int main() { InstallTerminationHandler(); StartServers(); int sig = WaitForTermination(); ... }
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>

namespace sparsex {
namespace internal {
inline int termination_pipe[2] = {-1, -1};
inline void OnTerminationSignal(int sig) {
  const char c = static_cast<char>(sig);
  const int saved = errno;
  (void)!write(termination_pipe[1], &c, 1);
  errno = saved;
}
}  // namespace internal

inline void InstallTerminationHandler() {
  if (internal::termination_pipe[0] >= 0) return;
  if (pipe2(internal::termination_pipe, O_CLOEXEC) != 0) return;
  struct sigaction sa {};
  sa.sa_handler = internal::OnTerminationSignal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
  signal(SIGPIPE, SIG_IGN);
}

inline int WaitForTermination() {
  char c = 0;
  while (read(internal::termination_pipe[0], &c, 1) < 0 && errno == EINTR) {
  }
  return static_cast<unsigned char>(c);
}

}  // namespace sparsex
