// Debian's civetweb creates its threads with a fixed 100 KiB stack (built with USE_STACK_SIZE),
// and glibc carves the static TLS of every loaded library out of each thread's stack. In a
// CUDA-enabled binary libcublasLt alone has 94 KiB of TLS, so pthread_create fails with EINVAL
// and civetweb reports "Cannot create first worker thread". Every binary that links
// sparsex_metrics exports this definition (see CMakeLists.txt), which interposes the C
// library's for the whole process and raises stack requests below 1 MiB; callers asking for
// more, and threads created without an explicit size, are unaffected.
#include <dlfcn.h>
#include <pthread.h>

#include <algorithm>
#include <cerrno>

extern "C" int pthread_attr_setstacksize(pthread_attr_t* attr, size_t size) {
  using Fn = int (*)(pthread_attr_t*, size_t);
  static const Fn real = reinterpret_cast<Fn>(dlsym(RTLD_NEXT, "pthread_attr_setstacksize"));
  if (real == nullptr) return ENOSYS;
  return real(attr, std::max<size_t>(size, size_t{1} << 20));
}
