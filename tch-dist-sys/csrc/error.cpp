#include "common.h"

#include <algorithm>
#include <cctype>

namespace {
thread_local std::string last_error;

bool contains(const std::string& hay, const char* needle) { return hay.find(needle) != std::string::npos; }
} // namespace

namespace tdx {
int set_error(int code, const std::string& msg) {
  last_error = msg;
  return code;
}

// c10d reports most failures as c10::Error or gloo's own exception types (whose headers the wheel lacks), so
// the kind is read from the message; the message itself always travels with the code.
int classify(const std::string& msg, int fallback) {
  std::string m(msg);
  std::transform(m.begin(), m.end(), m.begin(), [](unsigned char c) { return std::tolower(c); });
  if (contains(m, "timed out") || contains(m, "timeout")) return TDX_ETIMEOUT;
  if (contains(m, "connection") || contains(m, "closed by peer") || contains(m, "reset by peer") ||
      contains(m, "broken pipe") || contains(m, "connect to") || contains(m, "socket"))
    return TDX_ENETWORK;
  if (contains(m, "no gpus found") || contains(m, "not compiled with") || contains(m, "invalid device") ||
      contains(m, "no cuda gpus"))
    return TDX_EUNAVAILABLE;
  return fallback;
}
} // namespace tdx

extern "C" const char* tdx_last_error(void) { return last_error.c_str(); }
