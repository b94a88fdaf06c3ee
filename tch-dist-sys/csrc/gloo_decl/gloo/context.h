// Declaration only: see ../README.md.
#pragma once
#include <chrono>
namespace gloo {
class Context {
 public:
  void setTimeout(std::chrono::milliseconds timeout);
};
} // namespace gloo
