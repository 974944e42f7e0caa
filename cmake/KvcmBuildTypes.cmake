# Extra build types for the test command:
#   Asan: AddressSanitizer + UndefinedBehaviorSanitizer, any error aborts the test.
#   Tsan: ThreadSanitizer, for the concurrency tests.
#   Fuzz: the fuzz targets' build (clang): Asan's sanitizers plus libFuzzer's coverage
#         instrumentation on every target; fuzz/ links the fuzzers with libFuzzer's main.
#
# Debug information is line tables (-g1) unless KVCM_FULL_DEBUG_INFO is ON: that is what
# backtraces, sanitizer reports and profilers read, and the objects are a quarter of the size
# (a third less compile time, much less link time: the test command builds four trees).
# RelWithDebInfo follows it too; KVCM_FULL_DEBUG_INFO=ON gives a debugger everything (-g).
option(KVCM_FULL_DEBUG_INFO "full debug information (-g) instead of line tables (-g1)" OFF)
if(KVCM_FULL_DEBUG_INFO)
  set(KVCM_DEBUG_INFO "-g")
else()
  set(KVCM_DEBUG_INFO "-g1")
  # A normal variable over the cache's "-O2 -g -DNDEBUG", for every directory below.
  set(CMAKE_CXX_FLAGS_RELWITHDEBINFO "-O2 -g1 -DNDEBUG")
endif()
foreach(kind Asan Tsan Fuzz)
  string(TOUPPER ${kind} upper)
  if(kind STREQUAL "Asan")
    set(san "-fsanitize=address,undefined -fno-sanitize-recover=all")
  elseif(kind STREQUAL "Fuzz")
    set(san "-fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=all")
  else()
    set(san "-fsanitize=thread")
  endif()
  set(CMAKE_CXX_FLAGS_${upper} "-O1 ${KVCM_DEBUG_INFO} -fno-omit-frame-pointer ${san}" CACHE STRING "" FORCE)
  set(CMAKE_C_FLAGS_${upper} "-O1 ${KVCM_DEBUG_INFO} -fno-omit-frame-pointer ${san}" CACHE STRING ""
      FORCE)
  set(CMAKE_EXE_LINKER_FLAGS_${upper} "${san}" CACHE STRING "" FORCE)
  set(CMAKE_SHARED_LINKER_FLAGS_${upper} "${san}" CACHE STRING "" FORCE)
  mark_as_advanced(CMAKE_CXX_FLAGS_${upper} CMAKE_C_FLAGS_${upper}
                   CMAKE_EXE_LINKER_FLAGS_${upper} CMAKE_SHARED_LINKER_FLAGS_${upper})
endforeach()
