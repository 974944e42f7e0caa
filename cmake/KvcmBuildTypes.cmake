# Extra build types for the test command:
#   Asan: AddressSanitizer + UndefinedBehaviorSanitizer, any error aborts the test.
#   Tsan: ThreadSanitizer, for the concurrency tests.
foreach(kind Asan Tsan)
  string(TOUPPER ${kind} upper)
  if(kind STREQUAL "Asan")
    set(san "-fsanitize=address,undefined -fno-sanitize-recover=all")
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
