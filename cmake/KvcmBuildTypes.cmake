# Extra build types for the test command:
#   Asan: AddressSanitizer + UndefinedBehaviorSanitizer, any error aborts the test.
#   Tsan: ThreadSanitizer, for the concurrency tests.
#   Fuzz: the fuzz targets' build (clang): Asan's sanitizers plus libFuzzer's coverage
#         instrumentation on every target; fuzz/ links the fuzzers with libFuzzer's main.
foreach(kind Asan Tsan Fuzz)
  string(TOUPPER ${kind} upper)
  if(kind STREQUAL "Asan")
    set(san "-fsanitize=address,undefined -fno-sanitize-recover=all")
  elseif(kind STREQUAL "Fuzz")
    set(san "-fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=all")
  else()
    set(san "-fsanitize=thread")
  endif()
  set(CMAKE_CXX_FLAGS_${upper} "-O1 -g -fno-omit-frame-pointer ${san}" CACHE STRING "" FORCE)
  set(CMAKE_C_FLAGS_${upper} "-O1 -g -fno-omit-frame-pointer ${san}" CACHE STRING "" FORCE)
  set(CMAKE_EXE_LINKER_FLAGS_${upper} "${san}" CACHE STRING "" FORCE)
  set(CMAKE_SHARED_LINKER_FLAGS_${upper} "${san}" CACHE STRING "" FORCE)
  mark_as_advanced(CMAKE_CXX_FLAGS_${upper} CMAKE_C_FLAGS_${upper}
                   CMAKE_EXE_LINKER_FLAGS_${upper} CMAKE_SHARED_LINKER_FLAGS_${upper})
endforeach()
