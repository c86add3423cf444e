// engine/src/core/config.cpp compiled for the fuzzers from inside fuzz/ (CMakeLists.txt says why).
#include "../../engine/src/core/config.cpp"
