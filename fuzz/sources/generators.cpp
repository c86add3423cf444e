// scheduler/src/generators.cpp compiled for the fuzzers from inside fuzz/ (CMakeLists.txt says why).
#include "../../scheduler/src/generators.cpp"
