#pragma once
// Catch2 for test programs that include LibTorch headers. c10/util/Logging.h defines its own CHECK, a fatal check
// that aborts the whole test program (later test cases never run) and replaces Catch's CHECK wherever it comes
// after catch.hpp. Included first here and its CHECK dropped, Catch's definition is the one that stays: the header's
// include guard keeps every later LibTorch include from defining it again.
#include <c10/util/Logging.h>
#undef CHECK
#include <catch2/catch.hpp>
