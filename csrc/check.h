// Input checks of the extension: MSB_CHECK(cond, pieces...) raises a RuntimeError whose message is
// the pieces (strings and numbers) joined, as TORCH_CHECK does.
//
// Why not TORCH_CHECK's own formatting: it joins the pieces with std::ostringstream, and on the
// H200 image (torch 2.11, g++ 13 through a wrapper) any std::ostringstream in an extension
// crashes the process. A bad argument then killed the run with a segfault instead of naming
// itself. These messages are built with std::string and std::to_string only.
#pragma once

#include <string>
#include <type_traits>

#include <c10/util/Exception.h>

namespace sparsebalance {
namespace detail {

inline std::string message_piece(const char* s) { return s; }
inline std::string message_piece(const std::string& s) { return s; }
template <typename T, std::enable_if_t<std::is_arithmetic_v<T>, int> = 0>
std::string message_piece(T v) {
  return std::to_string(v);
}

template <typename... Pieces>
std::string message(const Pieces&... pieces) {
  std::string out;
  ((out += message_piece(pieces)), ...);
  return out;
}

}  // namespace detail
}  // namespace sparsebalance

// The message is built only when the check fails.
#define MSB_CHECK(cond, ...) TORCH_CHECK(cond, ::sparsebalance::detail::message(__VA_ARGS__).c_str())
