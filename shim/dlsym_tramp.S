/* dlsym(handle, name): ask gs_dlsym_filter; if it declines (returns 0),
 * tail-jump to the real dlsym with the caller's arguments and return
 * address, so glibc resolves RTLD_NEXT relative to the real caller. */
#if defined(__x86_64__)
    .text
    .globl dlsym
    .type dlsym, @function
dlsym:
    .cfi_startproc
    pushq %rdi
    .cfi_adjust_cfa_offset 8
    pushq %rsi
    .cfi_adjust_cfa_offset 8
    subq $8, %rsp                 /* 16-byte alignment for the call */
    .cfi_adjust_cfa_offset 8
    call gs_dlsym_filter
    addq $8, %rsp
    .cfi_adjust_cfa_offset -8
    popq %rsi
    .cfi_adjust_cfa_offset -8
    popq %rdi
    .cfi_adjust_cfa_offset -8
    testq %rax, %rax
    jz 1f
    ret
1:
    jmp *gs_real_dlsym(%rip)
    .cfi_endproc
    .size dlsym, .-dlsym
#elif defined(__aarch64__)
    .text
    .globl dlsym
    .type dlsym, %function
dlsym:
    stp x29, x30, [sp, #-32]!
    mov x29, sp
    stp x0, x1, [sp, #16]
    bl gs_dlsym_filter
    mov x9, x0
    ldp x0, x1, [sp, #16]
    ldp x29, x30, [sp], #32
    cbz x9, 1f
    mov x0, x9
    ret
1:
    adrp x16, gs_real_dlsym
    ldr x16, [x16, :lo12:gs_real_dlsym]
    br x16
    .size dlsym, .-dlsym
#else
#error "libgpuslice supports x86-64 and aarch64"
#endif
    .section .note.GNU-stack,"",@progbits
