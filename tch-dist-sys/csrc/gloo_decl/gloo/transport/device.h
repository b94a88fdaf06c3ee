// Declaration only: see ../../README.md. Held only through smart pointers by ProcessGroupGloo.
#pragma once
namespace gloo {
namespace transport {
class Device;
class UnboundBuffer;
} // namespace transport
} // namespace gloo
