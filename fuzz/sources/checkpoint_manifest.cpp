// engine/src/checkpoint/checkpoint_manifest.cpp compiled for the fuzzers from inside fuzz/ (CMakeLists.txt says why).
#include "../../engine/src/checkpoint/checkpoint_manifest.cpp"
