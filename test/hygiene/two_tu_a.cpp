// Linked with two_tu_b.cpp: an inline variable or function defined in a
// header without `inline` would be a duplicate symbol here.
#include <gradsync/gradsync.hpp>

#include "two_tu_use.hpp"

int a_main() { return use_library<gradsync::Ring>(1.0f); }
